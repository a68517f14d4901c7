"""Decode side over NIXL: receives one-sided writes into its pool and the notifications after.

Everything happens in `poll()`, on the scheduler thread: drain notifications (which also
drives UCX progress for incoming writes), ping the sources (a send to a dead peer fails at
once, which is how a killed prefill is noticed), expire leases, report fenced rooms.
"""
from __future__ import annotations

import logging
import secrets
from collections import Counter
from typing import TYPE_CHECKING, Sequence

from .base import TransferConfig, TransferTarget
from .bootstrap import BootstrapInfo
from .events import Fenced, PeerConnected, PeerDead, RoomAborted, RoomDone, RoomFailed, TargetEvent
from .layout import LayoutMismatch, PoolLayout
from .nixl_backend import NixlEndpoint, TransportError, receive_messages, send_message
from .rooms import Outcome, RoomEvent, RoomState, RoomTable
from .wire import Abort, Done, Fail, Fence, Hello, Message, Ping, WireError, decode

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class NixlTarget(TransferTarget):
    def __init__(self, name: str, pool: Sequence[torch.Tensor],
                 config: TransferConfig | None = None):
        self.name = name
        self.config = config or TransferConfig()
        self.layout = PoolLayout.of(pool)
        self._pool = list(pool)  # registered memory must outlive the agent
        self._ep = NixlEndpoint(name, self.layout)
        self._info = BootstrapInfo(name, secrets.token_hex(8), self._ep.metadata, self.layout)
        c = self.config
        self.rooms = RoomTable(c.clock, tombstone_ttl_s=c.tombstone_ttl_s,
                               fence_lease_s=c.fence_lease_s, room_lease_s=c.room_lease_s)
        self._sources: dict[str, str] = {}      # connected source -> its incarnation
        self._last_ping: dict[str, float] = {}
        self._events: list[TargetEvent] = []
        self.counters: Counter[str] = Counter()

    # ---- the scheduler's calls -------------------------------------------------------------
    def bootstrap_info(self) -> bytes:
        return self._info.to_bytes()

    def expect(self, room: str, source: str | None = None) -> bool:
        return self.rooms.apply(room, RoomEvent.ALLOCATE, peer=source) is Outcome.APPLIED

    def abort(self, room: str) -> None:
        if self.rooms.abort(room) is Outcome.APPLIED:
            self._tell_source(room)

    def peer_gone(self, rooms: Sequence[str], reason: str) -> None:
        for room in rooms:
            if self.rooms.gone(room, reason):
                self._events.append(RoomFailed(room, f"the prefill worker is dead: {reason}", peer_dead=True))

    def send_control(self, peer: str, msg: Message) -> bool:
        if peer not in self._sources:
            return False
        return send_message(self._ep, peer, msg, self._peer_dead, self.counters, self.name)

    def poll(self) -> list[TargetEvent]:
        for peer, raw in receive_messages(self._ep, self.counters, self.name):
            self._on_notif(peer, raw)
        self._heartbeat()
        for room in self.rooms.tick():
            self._events.append(RoomFailed(room, "room lease expired"))
            self._tell_source(room)
        for rel in self.rooms.take_releases():
            self._events.append(Fenced(rel.room, rel.reason))
        out, self._events = self._events, []
        return out

    def state(self, room: str) -> RoomState:
        return self.rooms.state(room)

    def metrics(self) -> dict[str, int]:
        return {**self.rooms.metrics(), **self.counters, "peers": len(self._sources)}

    def close(self) -> None:
        self._ep.close()

    # ---- messages --------------------------------------------------------------------------
    def _on_notif(self, peer: str, raw: bytes) -> None:
        try:
            msg = decode(raw)
        except WireError as e:
            self.counters["bad_messages"] += 1
            logger.warning("%s: dropped a malformed notification from %s: %s", self.name, peer, e)
            return
        if isinstance(msg, Done):
            self._on_done(peer, msg)
        elif isinstance(msg, Abort):
            self._on_end(peer, msg.room, RoomEvent.ABORT, "aborted by source")
        elif isinstance(msg, Fail):
            self._on_end(peer, msg.room, RoomEvent.FAIL, msg.reason or "failed by source")
        elif isinstance(msg, Fence):
            self.rooms.fence(msg.room, "sender fence")
        elif isinstance(msg, Hello):
            self._on_hello(peer, msg.info)
        elif isinstance(msg, Ping):
            pass

    def _on_done(self, peer: str, msg: Done) -> None:
        rec = self.rooms.get(msg.room)
        if rec is not None and rec.peer is not None and rec.peer != peer:
            self.counters["peer_mismatch"] += 1
        outcome = self.rooms.apply(msg.room, RoomEvent.COMPLETE, peer=peer)
        if outcome is Outcome.APPLIED:
            self._events.append(RoomDone(msg.room, msg.payload, peer))
        elif outcome is Outcome.LATE:
            # The completion comes after the data: that write is over, nothing is in flight.
            self.rooms.fence(msg.room, "late completion")

    def _on_end(self, peer: str, room: str, event: RoomEvent, reason: str) -> None:
        if self.rooms.apply(room, event, peer=peer, reason=reason) is not Outcome.APPLIED:
            return
        rec = self.rooms.get(room)
        if rec is None or not rec.has_blocks:
            return  # a tombstone: a later expect() is refused
        if event is RoomEvent.ABORT:
            self._events.append(RoomAborted(room, peer))
        else:
            self._events.append(RoomFailed(room, reason))

    def _on_hello(self, peer: str, raw_info: bytes) -> None:
        try:
            info = BootstrapInfo.from_bytes(raw_info)
            if info.agent != peer:
                raise ValueError(f"HELLO from {peer} names {info.agent}")
            self.layout.check_compatible(info.layout, peer)
        except (ValueError, LayoutMismatch) as e:
            self.counters["hello_refused"] += 1
            logger.error("%s: refused source %s: %s", self.name, peer, e)
            return
        old = self._sources.get(peer)
        if old == info.incarnation:
            return
        if old is not None:
            self._peer_dead(peer, "restarted")
        try:
            self._ep.add_peer(peer, info.metadata)
        except TransportError as e:
            self.counters["hello_refused"] += 1
            logger.error("%s: cannot load source %s: %s", self.name, peer, e)
            return
        self._sources[peer] = info.incarnation
        self._last_ping[peer] = self.config.clock()
        self._events.append(PeerConnected(peer))
        # Rooms of this source that ended here before it connected could not be told; tell
        # it now, so that it refuses to start their writes.
        for rec in self.rooms.rooms():
            if rec.peer == peer and rec.state in (RoomState.ABORTED, RoomState.FAILED):
                self.send_control(peer, Abort(rec.id))

    # ---- peers -----------------------------------------------------------------------------
    def _tell_source(self, room: str) -> None:
        rec = self.rooms.get(room)
        if rec is not None and rec.peer is not None:
            self.send_control(rec.peer, Abort(room))

    def _heartbeat(self) -> None:
        now = self.config.clock()
        for peer in list(self._sources):
            if now - self._last_ping.get(peer, 0.0) >= self.config.heartbeat_s:
                self._last_ping[peer] = now
                self.send_control(peer, Ping())

    def _peer_dead(self, peer: str, reason: str) -> None:
        self._sources.pop(peer, None)
        self._last_ping.pop(peer, None)
        self._ep.remove_peer(peer)
        for room in self.rooms.peer_dead(peer, reason):
            self._events.append(RoomFailed(room, f"source {peer} dead: {reason}", peer_dead=True))
        self._events.append(PeerDead(peer, reason))
        logger.warning("%s: source %s dead: %s", self.name, peer, reason)
