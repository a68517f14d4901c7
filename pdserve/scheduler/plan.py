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
    """A request to serve. `kv` says where its KV cache comes from and goes to:
    "local" (prefill and decode here), "prefill" (prefill here, then hand the KV to a decode
    worker) or "decode" (the KV arrives from a prefill worker into blocks allocated now)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    kv: str = "local"
    peer: dict | None = None  # transfer details for the worker loop (peer agent, blocks)


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
class TransferOutcome:
    """A room's transfer result, agreed across ranks: "arrived" (decode: the KV and first token
    landed on every rank), "written" (prefill: sent from every rank), "failed" (on any rank),
    "fenced" (every rank: nothing can write the room's blocks any more; they may be reused)."""

    request_id: str
    kind: str
    token: SampledToken | None = None
    error: str | None = None


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
    transfers: list[TransferOutcome] = field(default_factory=list)
    aborted: list[tuple[str, str]] = field(default_factory=list)  # (request id, reason)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (request id, error message)
    admitted: list[NewRequest] = field(default_factory=list)
    deferred: list[NewRequest] = field(default_factory=list)  # decode rooms waiting for free blocks
    preempted: list[str] = field(default_factory=list)
    batch: list[ScheduledChunk] = field(default_factory=list)
    shutdown: bool = False
    error: str | None = None  # why the worker stops (a divergence, a failed rank)

    @property
    def idle(self) -> bool:
        return not (self.sampled or self.transfers or self.aborted or self.rejected or self.admitted
                    or self.batch)


@dataclass
class StepOutput:
    """What a request produced in a step: a token, and/or its end (finish_reason set)."""

    request_id: str
    token_id: int | None = None
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "prefilled"
    error: str | None = None
    room_blocks: list[int] | None = None  # decode: blocks allocated for the room's KV
