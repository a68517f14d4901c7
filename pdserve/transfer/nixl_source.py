"""Prefill side over NIXL: writes source blocks into a target's blocks, then the completion.

A write is one prepared NIXL request (every block of every pool tensor, one descriptor each)
whose notification carries `Done(room, payload)`, so the payload lands after the data. The
handle stays in `_inflight` until it reaches DONE or ERR, and is released then, exactly once.
Aborting a room never releases its handle early (that would not stop the data): the room
turns ABORTED at once and is fenced when the handle drains; the target is told both.
"""
from __future__ import annotations

import logging
import secrets
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from pdserve.logs import about

from .base import TransferConfig, TransferSource
from .bootstrap import BootstrapInfo
from .events import Fenced, PeerDead, RoomAborted, RoomFailed, RoomWritten, SourceEvent
from .layout import PoolLayout
from .nixl_backend import (NixlEndpoint, PeerGone, TransportError, XferHandle, XferStatus, receive_messages,
                           send_message)
from .rooms import Outcome, RoomEvent, RoomState, RoomTable
from .wire import Abort, Done, Fail, Fence, Hello, Message, Ping, WireError, decode, encode

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Peer:
    name: str
    incarnation: str
    layout: PoolLayout


class NixlSource(TransferSource):
    def __init__(self, name: str, pool: Sequence[torch.Tensor],
                 config: TransferConfig | None = None):
        self.name = name
        self.config = config or TransferConfig()
        self.layout = PoolLayout.of(pool)
        self._pool = list(pool)  # registered memory must outlive the agent
        self._ep = NixlEndpoint(name, self.layout)
        info = BootstrapInfo(name, secrets.token_hex(8), self._ep.metadata, self.layout)
        self._hello = Hello(info.to_bytes())
        c = self.config
        self.rooms = RoomTable(c.clock, tombstone_ttl_s=c.tombstone_ttl_s,
                               fence_lease_s=c.fence_lease_s, room_lease_s=c.room_lease_s)
        self._peers: dict[str, _Peer] = {}
        # target → the incarnation of it seen dead: a room admitted with that process's cached
        # bootstrap, which cannot connect, fails as a dead peer's (typed)
        self._dead: dict[str, str] = {}
        self._inflight: dict[str, XferHandle] = {}
        self._events: list[SourceEvent] = []
        self.counters: Counter[str] = Counter()

    # ---- the scheduler's calls -------------------------------------------------------------
    def connect(self, peer_info: bytes) -> str:
        info = BootstrapInfo.from_bytes(peer_info)
        self.layout.check_compatible(info.layout, info.agent)
        old = self._peers.get(info.agent)
        if old is not None and old.incarnation == info.incarnation:
            return info.agent
        if old is not None:
            self._peer_dead(info.agent, "restarted")
        try:
            self._ep.add_peer(info.agent, info.metadata, info.layout)
            try:
                self._ep.send(info.agent, self._hello)
            except TransportError:
                self._ep.remove_peer(info.agent)
                raise
        except TransportError:
            if self._dead.get(info.agent) == info.incarnation:
                return info.agent  # still dead, not connected: `write` fails its rooms as a dead peer's
            raise
        self._dead.pop(info.agent, None)  # it answers: alive after all (paused, not dead)
        self._peers[info.agent] = _Peer(info.agent, info.incarnation, info.layout)
        return info.agent

    def write(self, room: str, peer: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
              payload: bytes = b"") -> bool:
        if self.rooms.apply(room, RoomEvent.ALLOCATE, peer=peer) is not Outcome.APPLIED:
            return False
        p = self._peers.get(peer)
        problem = ""
        if p is None and peer in self._dead:
            self._fail(room, f"target {peer} dead", peer_dead=True)
            return True
        if p is None:
            problem = f"not connected to {peer}"
        elif len(src_blocks) != len(dst_blocks):
            problem = f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks"
        elif not (self.layout.blocks_valid(src_blocks) and p.layout.blocks_valid(dst_blocks)):
            problem = "block index out of range"
        if p is None or problem:
            self._fail(room, problem)
            return True
        notif = encode(Done(room, payload))
        try:
            if not src_blocks:  # nothing to copy: the completion alone
                self._ep.send(peer, Done(room, payload))
                self.rooms.apply(room, RoomEvent.START)
                self._complete(room, peer)
                return True
            handle = self._ep.make_write(peer, self.layout.indices(src_blocks),
                                         p.layout.indices(dst_blocks), notif)
        except PeerGone as e:
            self._peer_dead(peer, str(e))
            return True
        except TransportError as e:
            self._fail(room, str(e))
            return True
        self.rooms.apply(room, RoomEvent.START)
        self._inflight[room] = handle
        self._advance(room, handle, post=True)
        return True

    def abort(self, room: str) -> None:
        if self.rooms.abort(room) is not Outcome.APPLIED:
            return
        rec = self.rooms.get(room)
        if rec is not None and rec.peer is not None:
            self._send(rec.peer, Abort(room))
        self._fence_if_idle(room)

    def peer_gone(self, rooms: Sequence[str], reason: str) -> None:
        for room in rooms:
            handle = self._inflight.pop(room, None)
            if handle is not None:  # its target is dead: nothing of this write can land any more
                handle.release()
            if self.rooms.gone(room, reason):
                self._events.append(RoomFailed(room, f"the decode worker is dead: {reason}", peer_dead=True))

    def forget_peer(self, peer: str) -> None:
        # Tell it first, in case it is alive after all: its rooms fail, idle ones are fenced.
        for rec in self.rooms.rooms():
            if rec.peer == peer and not rec.state.terminal:
                self._fail(rec.id, "peer forgotten")
        self._peer_dead(peer, "forgotten")
        self._dead.pop(peer, None)  # dropped, not seen dead: it may be connected again

    def poll(self) -> list[SourceEvent]:
        for room, handle in list(self._inflight.items()):
            if self._inflight.get(room) is handle:  # else drained meanwhile (its peer died)
                self._advance(room, handle, post=False)
        for peer, raw in receive_messages(self._ep, self.counters, self.name):
            self._on_notif(peer, raw)
        for room in self.rooms.tick():
            self._after_failure(room, "room lease expired")
        for rel in self.rooms.take_releases():
            self._events.append(Fenced(rel.room, rel.reason))
        out, self._events = self._events, []
        return out

    def state(self, room: str) -> RoomState:
        return self.rooms.state(room)

    def metrics(self) -> dict[str, int]:
        return {**self.rooms.metrics(), **self.counters, "peers": len(self._peers),
                "writes_in_flight": len(self._inflight)}

    def close(self) -> None:
        for room, handle in list(self._inflight.items()):
            del self._inflight[room]
            handle.release()
        self._ep.close()

    # ---- transfers -------------------------------------------------------------------------
    def _advance(self, room: str, handle: XferHandle, *, post: bool) -> None:
        """Post or check one write; on a terminal status release it and settle the room."""
        reason, dead = "", False
        try:
            status = handle.post() if post else handle.state()
        except PeerGone as e:
            status, reason, dead = XferStatus.ERR, str(e), True
        except TransportError as e:
            status, reason = XferStatus.ERR, str(e)
        if status is XferStatus.PROC:
            return
        del self._inflight[room]
        handle.release()
        if status is XferStatus.DONE:
            if self.rooms.state(room) is RoomState.TRANSFERRING:
                self._complete(room, handle.peer)
            else:  # ended while in flight: now drained, nothing of it can still be written
                self.rooms.fence(room, "write drained")
                self._send(handle.peer, Fence(room))
        elif dead:
            self._peer_dead(handle.peer, reason)
        else:
            self._fail(room, reason or "transfer error")

    def _complete(self, room: str, peer: str) -> None:
        self.rooms.apply(room, RoomEvent.COMPLETE)
        self._events.append(RoomWritten(room, peer))

    def _fail(self, room: str, reason: str, peer_dead: bool = False) -> None:
        if self.rooms.apply(room, RoomEvent.FAIL, reason=reason) is Outcome.APPLIED:
            self._after_failure(room, reason, peer_dead)
        else:
            self._fence_if_idle(room)

    def _after_failure(self, room: str, reason: str, peer_dead: bool = False) -> None:
        """A room failed here: report it, tell the target, fence it if no write is in flight."""
        self._events.append(RoomFailed(room, reason, peer_dead))
        logger.warning("%s: room %s failed: %s", self.name, room, reason, extra=about(room))
        rec = self.rooms.get(room)
        if rec is not None and rec.peer is not None:
            self._send(rec.peer, Fail(room, reason))
        self._fence_if_idle(room)

    def _fence_if_idle(self, room: str) -> None:
        rec = self.rooms.get(room)
        if rec is None or room in self._inflight or rec.fenced:
            return
        self.rooms.fence(room, "no write in flight")
        if rec.peer is not None:
            self._send(rec.peer, Fence(room))

    # ---- peers -----------------------------------------------------------------------------
    def _on_notif(self, peer: str, raw: bytes) -> None:
        try:
            msg = decode(raw)
        except WireError as e:
            self.counters["bad_messages"] += 1
            logger.warning("%s: dropped a malformed notification from %s: %s", self.name, peer, e)
            return
        if isinstance(msg, Abort):
            self._on_abort(peer, msg.room)
        elif isinstance(msg, Ping):
            pass
        else:
            self.counters[f"unexpected_{type(msg).__name__.lower()}"] += 1

    def _on_abort(self, peer: str, room: str) -> None:
        """The target aborted: abort here too (unknown -> tombstone, so a later write is
        refused) and answer with a fence as soon as no write of the room is in flight."""
        outcome = self.rooms.apply(room, RoomEvent.ABORT, peer=peer)
        rec = self.rooms.get(room)
        if outcome is Outcome.APPLIED and rec is not None and rec.has_blocks:
            self._events.append(RoomAborted(room, peer))
        if room in self._inflight:
            return  # the fence goes out when the write drains
        if rec is not None and not rec.fenced:
            self.rooms.fence(room, "no write in flight")
        self._send(peer, Fence(room))

    def _send(self, peer: str, msg: Message) -> bool:
        if peer not in self._peers:
            return False
        return send_message(self._ep, peer, msg, self._peer_dead, self.counters, self.name)

    def _peer_dead(self, peer: str, reason: str) -> None:
        gone = self._peers.pop(peer, None)
        if gone is not None:
            self._dead[peer] = gone.incarnation
        for room, handle in list(self._inflight.items()):
            if handle.peer == peer:  # the peer is gone: nothing of these writes can land
                del self._inflight[room]
                handle.release()
        self._ep.remove_peer(peer)
        for room in self.rooms.peer_dead(peer, reason):
            self._events.append(RoomFailed(room, f"target {peer} dead: {reason}", peer_dead=True))
        if gone is not None:
            self._events.append(PeerDead(peer, reason))
            logger.warning("%s: target %s dead: %s", self.name, peer, reason)
