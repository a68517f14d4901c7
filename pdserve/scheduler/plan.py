"""The messages of one scheduler step: what came in, what was decided, what went out.

A `StepPlan` holds every decision of a step that could differ between tensor-parallel ranks.
Rank 0 builds it; every rank applies it in the same order, so all ranks keep identical state.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import FinishReason, KVRole, TokenLogprobs


@dataclass(frozen=True)
class KVPeer:
    """The other worker of a PD request, as the transfer needs it.

    Decode side: `worker_id` is the prefill worker that will write the room (its agents are
    named after it). Prefill side: `worker_id` is the decode worker, `bootstrap` its per-rank
    transfer bootstrap (rank i writes to rank i) and `blocks` the room's blocks there that the
    KV goes to: those after the `cached_blocks` the decode worker's cache holds already."""

    worker_id: str
    bootstrap: tuple[str, ...] = ()
    blocks: tuple[int, ...] = ()
    cached_blocks: int = 0  # prefill side: the prompt's leading blocks the decode worker holds (not sent)


@dataclass
class NewRequest:
    """A request to serve. `kv` says where its KV cache comes from and goes to (`KVRole`);
    PD roles carry their `peer`."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    kv: KVRole = KVRole.LOCAL
    peer: KVPeer | None = None

    def __post_init__(self) -> None:
        self.kv = KVRole(self.kv)


@dataclass(frozen=True)
class PeerDeadRooms:
    """Rank 0's inbox item: the peer worker of these rooms died (its supervisor saw it)."""

    rooms: list[str]
    reason: str


@dataclass
class Inbox:
    """What rank 0 drained this step: new requests, aborts (id, reason), a shutdown request."""

    new: list[NewRequest] = field(default_factory=list)
    aborts: list[tuple[str, FinishReason]] = field(default_factory=list)
    peer_dead: list[tuple[str, str]] = field(default_factory=list)  # (room, why): its peer worker died
    reset_cache: bool = False  # forget the prefix cache (POST /reset_prefix_cache)
    shutdown: bool = False
    # rank 0 expects a finished request's next turn (follow_ups.py): a plan that hands out a last
    # token and would run decodes alone may hold them back this long for it
    follow_up_wait: float = 0.0


@dataclass
class SampledToken:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None
    cached_tokens: int = 0  # a first token from prefill: prompt tokens the prefill took from its cache


class TransferKind(Enum):
    """What a rank saw of a room's transfer; agreed across ranks, the same kinds mean:"""

    ARRIVED = "arrived"  # decode: the KV and first token landed (on every rank)
    WRITTEN = "written"  # prefill: the KV and first token were sent (from every rank)
    FAILED = "failed"    # the transfer failed (on any rank)
    FENCED = "fenced"    # nothing can write the room's blocks any more (on every rank)


@dataclass
class TransferOutcome:
    """A room's transfer result: per rank in an observation, agreed across ranks in a plan.
    `token` comes with ARRIVED, `error` with FAILED, `peer_dead` when it failed because the
    other worker's process is gone, and `aborted` when the other worker aborted the room (its
    client left): the request ends as aborted here too, not as failed."""

    request_id: str
    kind: TransferKind
    token: SampledToken | None = None
    error: str | None = None
    peer_dead: bool = False
    aborted: bool = False


@dataclass
class ScheduledChunk:
    """Compute the next `num_tokens` pending tokens of a request; sample if that reaches its end.
    `cached`: on a request's first chunk, the leading tokens whose KV it takes from the prefix
    cache instead of computing (whole blocks, then possibly part of a tail block); the chunk
    starts after them."""

    request_id: str
    num_tokens: int
    cached: int = 0


@dataclass
class StepPlan:
    """Everything a step does, in the order `Scheduler.apply` does it."""

    step: int
    sampled: list[SampledToken] = field(default_factory=list)  # last step's tokens, appended first
    transfers: list[TransferOutcome] = field(default_factory=list)
    aborted: list[tuple[str, FinishReason]] = field(default_factory=list)  # (request id, reason)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (request id, error message)
    cancelled: list[tuple[str, FinishReason]] = field(default_factory=list)  # new, aborted in the same inbox
    admitted: list[NewRequest] = field(default_factory=list)
    deferred: list[NewRequest] = field(default_factory=list)  # decode rooms waiting for free blocks
    room_hits: dict[str, int] = field(default_factory=dict)  # admitted decode room → its cached leading blocks
    preempted: list[str] = field(default_factory=list)
    batch: list[ScheduledChunk] = field(default_factory=list)
    shutdown: bool = False
    error: str | None = None  # why the worker stops (a divergence, a failed rank)
    peer_dead: list[tuple[str, str]] = field(default_factory=list)  # (room, why): fail + fence (kv_link)
    # last in `apply`, every rank forgets its prefix cache (`BlockAllocator.forget`): this step's
    # cache hits were taken already, later steps find nothing computed before
    reset_cache: bool = False
    # rank 0 waits up to this long for a request before the next step; the batch is empty
    # (Scheduler._holds_for_follow_up)
    follow_up_wait: float = 0.0

    @property
    def idle(self) -> bool:
        return not (self.sampled or self.transfers or self.aborted or self.rejected or self.cancelled
                    or self.admitted or self.batch or self.peer_dead or self.reset_cache)

    def for_followers(self) -> StepPlan:
        """The plan as the other TP ranks get it: its tokens without their logprobs. Only rank
        0's outputs reach clients, so the others need the ids alone: 256 tokens with 20 top
        logprobs each pickle to ≈ 103 KB, of the plan's 128 KiB buffer, and to ≈ 18 KB without."""
        def bare(token: SampledToken | None) -> SampledToken | None:
            return token if token is None or token.logprobs is None else replace(token, logprobs=None)
        return replace(self, sampled=[bare(s) for s in self.sampled],
                       transfers=[replace(t, token=bare(t.token)) for t in self.transfers])


@dataclass
class StepOutput:
    """What a request produced in a step: a token, and/or its end (finish_reason set)."""

    request_id: str
    token_id: int | None = None
    logprobs: TokenLogprobs | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    peer_dead: bool = False  # with an ERROR finish: its KV transfer failed because the other worker died
    worker_died: bool = False  # with an ERROR finish: a rank process of this worker died (it stops)
    room_blocks: list[int] | None = None  # decode: the room's blocks for the KV to be written
    room_cached: int = 0  # decode: the prompt's leading blocks its cache holds (before room_blocks)
    cached_tokens: int | None = None  # with the finish: prompt tokens this worker took from its cache
    # with the first token (rank 0, params.prompt_logprobs): never in a plan, whose size is fixed
    prompt_logprobs: list[TokenLogprobs | None] | None = None
