"""The transfer service seen by the scheduler: a target (decode side) and a source (prefill side).

One object per TP rank; prefill rank i writes to decode rank i. Both are driven by polling:
the scheduler thread calls `poll()` every loop iteration (no progress thread), and every method
is called from that one thread (they may block briefly in the transport, so never from the
asyncio loop). Each object owns a room table with the same state machine (`rooms.py`).

Contract for blocks: decode blocks of a room are in use from `expect()` until the request
ends (after `RoomDone`) or until `Fenced` (after FAILED/ABORTED). Prefill source blocks are in
use from an accepted `write()` until `RoomWritten` or `Fenced`.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .events import SourceEvent, TargetEvent
from .rooms import RoomState
from .wire import Message


@dataclass(frozen=True)
class TransferConfig:
    heartbeat_s: float = 0.25        # target pings the sources of its open rooms this often
    fence_lease_s: float = 30.0      # an ended room not fenced by then is fenced by lease
    room_lease_s: float | None = None  # a live room older than this fails (None: never)
    tombstone_ttl_s: float = 300.0   # how long ended rooms are remembered
    clock: Callable[[], float] = field(default=time.monotonic)


class TransferAgent(ABC):
    """What both sides have: a name, a room table to read, counters, and transport to release."""

    name: str

    @abstractmethod
    def state(self, room: str) -> RoomState:
        """NEW for unknown rooms."""

    @abstractmethod
    def metrics(self) -> dict[str, int]:
        """Counters (rooms by terminal state, late/illegal messages by kind) and gauges."""

    @abstractmethod
    def close(self) -> None:
        """Release every transport resource. The object is unusable afterwards."""


class TransferTarget(TransferAgent):
    """Decode side: owns the destination pool, receives one-sided writes."""

    @abstractmethod
    def bootstrap_info(self) -> bytes:
        """Bytes for the router to hand to the source of the same TP rank (`connect`)."""

    @abstractmethod
    def expect(self, room: str, source: str | None = None) -> bool:
        """Blocks are allocated for `room` (ALLOCATED). False: the room already ended (e.g.
        aborted first); free the blocks now. `source`: the agent that will write, if known
        (lets an abort reach it and its death fail the room)."""

    @abstractmethod
    def abort(self, room: str) -> None:
        """Idempotent. Live room: ABORTED, source told, blocks held until `Fenced`."""

    @abstractmethod
    def peer_gone(self, rooms: Sequence[str], reason: str) -> None:
        """The peer of these rooms is known dead (its supervisor saw every rank of it exit):
        live ones fail, all are fenced at once (nothing of a dead process writes any more); an
        unknown room gets a FAILED tombstone, so a later `expect` is refused. Rooms that
        completed are left alone."""

    @abstractmethod
    def send_control(self, peer: str, msg: Message) -> bool:
        """Send a standalone control message. False if the peer is unknown or dead."""

    @abstractmethod
    def poll(self) -> list[TargetEvent]:
        """Make progress and report. Call every scheduler iteration."""


class TransferSource(TransferAgent):
    """Prefill side: owns the source pool, writes into targets."""

    @abstractmethod
    def connect(self, peer_info: bytes) -> str:
        """Load a target's bootstrap info, check the layouts match (LayoutMismatch if not),
        introduce ourselves. Returns the peer name. Idempotent for the same incarnation; a new
        incarnation of a known name (restarted peer) replaces the old one (PeerDead for it)."""

    @abstractmethod
    def write(self, room: str, peer: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
              payload: bytes = b"") -> bool:
        """Start writing `src_blocks` into the peer's `dst_blocks` (same order) and then
        deliver `payload` with the completion. Non-blocking on RDMA; on same-host CMA the copy
        happens inside this call. True: accepted, then exactly one of RoomWritten, or
        RoomFailed/RoomAborted (or our own abort) followed by Fenced. False: refused, nothing
        was started by this call (the room already ended, e.g. aborted first, or is already
        being written)."""

    @abstractmethod
    def abort(self, room: str) -> None:
        """Idempotent. Live room: ABORTED, peer told; `Fenced` once no write is in flight."""

    @abstractmethod
    def peer_gone(self, rooms: Sequence[str], reason: str) -> None:
        """The target of these rooms is known dead: live ones fail, and with no write of theirs
        in flight (a write to a dead process is dropped) they are fenced; an unknown room gets
        a FAILED tombstone, so a later `write` is refused."""

    @abstractmethod
    def forget_peer(self, peer: str) -> None:
        """Drop a peer (known gone): its rooms fail and are fenced, its agent is unloaded."""

    @abstractmethod
    def poll(self) -> list[SourceEvent]:
        """Make progress and report. Call every scheduler iteration."""
