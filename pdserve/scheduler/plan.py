"""The messages of one scheduler step: what came in, what was decided, what went out.

A `StepPlan` holds every decision of a step that could differ between tensor-parallel ranks.
Rank 0 builds it; every rank applies it in the same order, so all ranks keep identical state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import TokenLogprobs


@dataclass
class NewRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0


@dataclass
class Inbox:
    """What rank 0 drained this step: new requests, aborts (id, reason), a shutdown request."""

    new: list[NewRequest] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)
    shutdown: bool = False


@dataclass
class SampledToken:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass
class ScheduledChunk:
    """Compute the next `num_tokens` pending tokens of a request; sample if that reaches its end."""

    request_id: str
    num_tokens: int


@dataclass
class StepPlan:
    """Everything a step does, in the order `Scheduler.apply` does it."""

    step: int
    sampled: list[SampledToken] = field(default_factory=list)  # last step's tokens, appended first
    aborted: list[tuple[str, str]] = field(default_factory=list)  # (request id, reason)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (request id, error message)
    admitted: list[NewRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    batch: list[ScheduledChunk] = field(default_factory=list)
    shutdown: bool = False

    @property
    def idle(self) -> bool:
        return not (self.sampled or self.aborted or self.rejected or self.admitted or self.batch)


@dataclass
class StepOutput:
    """What a request produced in a step: a token, and/or its end (finish_reason set)."""

    request_id: str
    token_id: int | None = None
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
