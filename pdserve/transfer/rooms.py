"""Rooms: one request's KV transfer, as a state machine plus a table of rooms and tombstones.

The same machine runs on both sides (prefill writes, decode receives):

    NEW -> ALLOCATED -> TRANSFERRING -> DONE | FAILED | ABORTED

`step` is the only place a state changes. Terminal states are sticky: a room that ended stays
in the table as a tombstone for a TTL, so a late message for it is recognised, dropped and
counted, and a late add is refused. Unknown rooms are an ordinary case, never an error.

Separately from the state, a room carries a *fence* latch: the blocks of a room that ended
FAILED or ABORTED may still be written by an in-flight transfer, so they are releasable only
once fenced (the sender says no write is in flight, the sender is dead, or a lease expired).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Callable, NamedTuple

from pdserve.logs import about

logger = logging.getLogger(__name__)


class RoomState(Enum):
    NEW = "new"
    ALLOCATED = "allocated"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({RoomState.DONE, RoomState.FAILED, RoomState.ABORTED})


class RoomEvent(Enum):
    ALLOCATE = "allocate"  # blocks reserved for the room (decode: destination, prefill: source)
    START = "start"        # a write was posted
    COMPLETE = "complete"  # the write and its completion notification landed
    FAIL = "fail"
    ABORT = "abort"


class Outcome(Enum):
    APPLIED = "applied"    # the state changed
    NOOP = "noop"          # an abort repeated on a room that already ended: idempotent
    LATE = "late"          # an event for a room that already ended: dropped
    REFUSED = "refused"    # an allocate for a room that already ended (e.g. aborted first)
    ILLEGAL = "illegal"    # not a move of the machine from a live state: counted and logged


class Transition(NamedTuple):
    state: RoomState
    outcome: Outcome


_MOVES: dict[tuple[RoomState, RoomEvent], RoomState] = {
    (RoomState.NEW, RoomEvent.ALLOCATE): RoomState.ALLOCATED,
    (RoomState.ALLOCATED, RoomEvent.START): RoomState.TRANSFERRING,
    # The decode side never sees the start of a one-sided write, only its completion.
    (RoomState.ALLOCATED, RoomEvent.COMPLETE): RoomState.DONE,
    (RoomState.TRANSFERRING, RoomEvent.COMPLETE): RoomState.DONE,
}


def step(state: RoomState, event: RoomEvent) -> Transition:
    """Apply one event to one state. Pure; the only definition of the machine."""
    if state.terminal:
        if event is RoomEvent.ABORT:
            return Transition(state, Outcome.NOOP)
        if event is RoomEvent.ALLOCATE:
            return Transition(state, Outcome.REFUSED)
        return Transition(state, Outcome.LATE)
    if event is RoomEvent.ABORT:
        return Transition(RoomState.ABORTED, Outcome.APPLIED)
    if event is RoomEvent.FAIL:
        return Transition(RoomState.FAILED, Outcome.APPLIED)
    nxt = _MOVES.get((state, event))
    if nxt is None:
        return Transition(state, Outcome.ILLEGAL)
    return Transition(nxt, Outcome.APPLIED)


@dataclass
class Room:
    """One room's record. `has_blocks`: it reached ALLOCATED, so blocks must come back."""

    id: str
    state: RoomState
    created_at: float
    peer: str | None = None
    has_blocks: bool = False
    fenced: bool = False
    fence_reason: str = ""
    reported: bool = False  # its release was reported (at most once)
    reason: str = ""
    ended_at: float | None = None

    @property
    def releasable(self) -> bool:
        """Blocks may be reused: the room ended, and unless it completed, it was fenced."""
        if self.state is RoomState.DONE:
            return True
        return self.state.terminal and self.fenced


class Release(NamedTuple):
    """A room whose blocks became reusable (reported once per room)."""

    room: str
    reason: str


class RoomTable:
    """Rooms and their tombstones, on one side of one transfer agent.

    Its tombstones are the transfer's own memory of ended rooms, one table per agent (per rank
    and side): they refuse a late `expect`/`write` and drop a peer's late message for a room,
    where no scheduler state exists (the peer's messages reach each rank's agent directly).
    The engine's memory of aborted requests and rank 0's settled rooms (lockstep) cannot stand
    in for it, nor it for them: they key requests and cross-rank decisions, not one agent's.

    Single-threaded: owned by the thread that polls the agent. The clock is injected.
    `fence_lease_s`: an ended room that was not fenced by then is fenced by lease.
    `room_lease_s`: a live room older than this fails (None: rooms never time out here).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, *,
                 tombstone_ttl_s: float = 300.0, fence_lease_s: float = 30.0,
                 room_lease_s: float | None = None):
        self._clock = clock
        self.tombstone_ttl_s = tombstone_ttl_s
        self.fence_lease_s = fence_lease_s
        self.room_lease_s = room_lease_s
        self._rooms: dict[str, Room] = {}
        self._releases: list[Release] = []
        self.counters: Counter[str] = Counter()

    def get(self, room: str) -> Room | None:
        return self._rooms.get(room)

    def state(self, room: str) -> RoomState:
        rec = self._rooms.get(room)
        return rec.state if rec is not None else RoomState.NEW

    def __contains__(self, room: str) -> bool:
        return room in self._rooms

    def __len__(self) -> int:
        return len(self._rooms)

    def rooms(self) -> list[Room]:
        return list(self._rooms.values())

    def apply(self, room: str, event: RoomEvent, *, peer: str | None = None,
              reason: str = "") -> Outcome:
        """Apply `event` to `room` (unknown rooms are in NEW). Never raises on a bad move."""
        rec = self._rooms.get(room)
        before = rec.state if rec is not None else RoomState.NEW
        nxt, outcome = step(before, event)
        if outcome is not Outcome.APPLIED:
            self._count_refusal(room, before, event, outcome, known=rec is not None)
            return outcome
        now = self._clock()
        if rec is None:
            rec = self._rooms[room] = Room(room, nxt, created_at=now)
        rec.state = nxt
        if peer is not None and rec.peer is None:
            rec.peer = peer
        if nxt is RoomState.ALLOCATED:
            rec.has_blocks = True
        if nxt.terminal:
            rec.ended_at, rec.reason = now, reason
            self.counters[f"rooms_{nxt.value}"] += 1
            if nxt is RoomState.DONE:
                rec.fenced, rec.fence_reason = True, "completed"
            self._maybe_release(rec)
        return outcome

    def abort(self, room: str, reason: str = "aborted") -> Outcome:
        """Idempotent: unknown -> tombstone, ended -> no-op, live -> ABORTED (held until fenced)."""
        return self.apply(room, RoomEvent.ABORT, reason=reason)

    def fence(self, room: str, reason: str) -> bool:
        """Latch the fence of `room`: no write for it is (or will be) in flight. True if known."""
        rec = self._rooms.get(room)
        if rec is None:
            self.counters["fence_unknown"] += 1
            return False
        if rec.fenced:
            self.counters["fence_repeated"] += 1
            return True
        rec.fenced, rec.fence_reason = True, reason
        self._maybe_release(rec)
        return True

    def peer_dead(self, peer: str, reason: str) -> list[str]:
        """The peer is gone: its live rooms fail, all its rooms are fenced. Returns the failed."""
        failed = []
        for rec in list(self._rooms.values()):
            if rec.peer != peer:
                continue
            if not rec.state.terminal:  # its transfer was under way when the peer died
                self.apply(rec.id, RoomEvent.FAIL, reason=reason)
                self.counters["peer_dead_failed_rooms"] += 1
                failed.append(rec.id)
            if not rec.fenced:
                self.fence(rec.id, f"peer dead: {reason}")
        return failed

    def gone(self, room: str, reason: str) -> bool:
        """`room`'s peer is known dead: a live room fails, any room is fenced (an unknown one
        becomes a FAILED tombstone). True when a live room with blocks failed here."""
        failed = (self.apply(room, RoomEvent.FAIL, reason=reason) is Outcome.APPLIED
                  and bool(self._rooms[room].has_blocks))
        if failed:
            self.counters["peer_dead_failed_rooms"] += 1
        self.fence(room, f"peer dead: {reason}")
        return failed

    def tick(self) -> list[str]:
        """Expire leases and tombstones. Returns the live rooms that failed by room lease."""
        now = self._clock()
        failed = []
        for rec in list(self._rooms.values()):
            if (not rec.state.terminal and self.room_lease_s is not None
                    and now - rec.created_at >= self.room_lease_s):
                self.apply(rec.id, RoomEvent.FAIL, reason="room lease expired")
                failed.append(rec.id)
            if rec.ended_at is None:
                continue
            if not rec.fenced and now - rec.ended_at >= self.fence_lease_s:
                self.fence(rec.id, "fence lease expired")
            held = rec.has_blocks and not rec.reported
            if not held and now - rec.ended_at >= self.tombstone_ttl_s:
                del self._rooms[rec.id]
                self.counters["tombstones_expired"] += 1
        return failed

    def take_releases(self) -> list[Release]:
        """Rooms whose blocks became reusable since the last call (FAILED/ABORTED, fenced)."""
        out, self._releases = self._releases, []
        return out

    def gauges(self) -> dict[str, int]:
        live = sum(1 for r in self._rooms.values() if not r.state.terminal)
        held = sum(1 for r in self._rooms.values()
                   if r.state.terminal and r.has_blocks and not r.releasable)
        return {"rooms_live": live, "rooms_unfenced": held,
                "tombstones": len(self._rooms) - live}

    def metrics(self) -> dict[str, int]:
        return {**self.counters, **self.gauges()}

    def _maybe_release(self, rec: Room) -> None:
        if rec.reported or not rec.releasable:
            return
        rec.reported = True
        if rec.state is not RoomState.DONE and rec.has_blocks:
            self._releases.append(Release(rec.id, rec.fence_reason))

    def _count_refusal(self, room: str, state: RoomState, event: RoomEvent,
                       outcome: Outcome, *, known: bool) -> None:
        if outcome is Outcome.LATE:
            key = f"late_{event.value}"
        elif outcome is Outcome.NOOP:
            key = "abort_repeated"
        elif outcome is Outcome.REFUSED:
            key = "allocate_refused"
        elif not known:
            key = f"unknown_{event.value}"
        else:
            key = f"illegal_{state.value}_{event.value}"
            logger.warning("room %s: illegal %s in state %s (ignored)", room, event.value,
                           state.value, extra=about(room))
        self.counters[key] += 1
        logger.debug("room %s: %s %s in state %s", room, outcome.value, event.value, state.value,
                     extra=about(room))
