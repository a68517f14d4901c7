"""A request held for a KV transfer: its states and the one table of how they change.

While a transfer may touch a request's blocks, the request is *held* (`SequenceStatus.held`):

    decode:   AWAITING_KV --ARRIVED--> RUNNING          (the KV landed: decode from here)
    prefill:  SENDING     --WRITTEN--> FINISHED         (report PREFILLED, blocks back)
    both:     AWAITING_KV | SENDING --FAILED | ABORT--> DRAINING --ARRIVED | WRITTEN | FENCED--> FINISHED

`step` is the only definition of these moves. `Scheduler.plan()` runs it on a projection of
the state to count the blocks a step frees; `Scheduler.apply()` runs it on the real state to
free them. So which blocks come back is decided in one place. A transfer's last word for a room
is ARRIVED, WRITTEN or FENCED: once it is in, nothing writes the room's blocks any more (an
arrival that comes after the room was aborted is such a last word too: its rank reported the
KV before it saw the abort, so no fence follows).
"""
from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from pdserve.engine.sequence import FinishReason, SequenceStatus

from .plan import TransferOutcome

S = SequenceStatus


class HeldEvent(Enum):
    """What can happen to a held request: an agreed transfer outcome, or the plan's abort."""

    ARRIVED = "arrived"
    WRITTEN = "written"
    FAILED = "failed"
    FENCED = "fenced"
    ABORT = "abort"

    @classmethod
    def of(cls, outcome: TransferOutcome) -> HeldEvent:
        """An agreed outcome's event; a room the other worker aborted is an abort here too."""
        return cls.ABORT if outcome.aborted else cls[outcome.kind.name]


class HeldMove(NamedTuple):
    """The new status, and the request's finish to report now (None: nothing to report).
    ABORT reports the plan's reason: its `finish` is ABORT as a marker."""

    status: SequenceStatus
    finish: FinishReason | None = None

    @property
    def frees_blocks(self) -> bool:
        return self.status is S.FINISHED


_MOVES: dict[tuple[SequenceStatus, HeldEvent], HeldMove] = {
    (S.AWAITING_KV, HeldEvent.ARRIVED): HeldMove(S.RUNNING),
    (S.AWAITING_KV, HeldEvent.FAILED): HeldMove(S.DRAINING, FinishReason.ERROR),
    (S.AWAITING_KV, HeldEvent.ABORT): HeldMove(S.DRAINING, FinishReason.ABORT),
    (S.SENDING, HeldEvent.WRITTEN): HeldMove(S.FINISHED, FinishReason.PREFILLED),
    (S.SENDING, HeldEvent.FAILED): HeldMove(S.DRAINING, FinishReason.ERROR),
    (S.SENDING, HeldEvent.ABORT): HeldMove(S.DRAINING, FinishReason.ABORT),
    (S.DRAINING, HeldEvent.FAILED): HeldMove(S.DRAINING),  # already ended: one report only
    (S.DRAINING, HeldEvent.ABORT): HeldMove(S.DRAINING),
}

_LAST_WORDS = frozenset({HeldEvent.ARRIVED, HeldEvent.WRITTEN, HeldEvent.FENCED})


def step(status: SequenceStatus, event: HeldEvent) -> HeldMove:
    """Apply one event to a held request. Pure; the only definition of these moves.

    Any other last word (a fence of a live room; a written room on the decode side) also ends
    the hold: nothing writes the blocks any more, so keeping them would only leak them. A
    request that is not held does not move."""
    move = _MOVES.get((status, event))
    if move is not None:
        return move
    if status.held and event in _LAST_WORDS:
        return HeldMove(S.FINISHED)
    return HeldMove(status)


def ended(reason: FinishReason) -> SequenceStatus:
    """The status of a running or waiting request that ends by `reason`: a prefilled request
    is held while its KV is sent; any other gives its blocks back."""
    return S.SENDING if reason is FinishReason.KV_PENDING else S.FINISHED
