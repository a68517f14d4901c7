"""One request's state inside a worker: its tokens, its cache blocks, its progress."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.structured import GrammarState


class SequenceStatus(enum.Enum):
    """Where a request is in its life. The three held states mean a KV transfer may touch its
    blocks; `scheduler/lifecycle.py` is the one table of how they change."""

    WAITING = "waiting"          # queued, or preempted (its cache dropped, to be recomputed)
    RUNNING = "running"          # holds blocks, is prefilling or decoding
    AWAITING_KV = "awaiting_kv"  # decode: blocks allocated, the KV and first token not landed yet
    SENDING = "sending"          # prefill: first token sampled, its KV being written to decode
    DRAINING = "draining"        # ended while a write may still touch its blocks: waits for the fence
    FINISHED = "finished"

    @property
    def held(self) -> bool:
        return self in _HELD


_HELD = frozenset({SequenceStatus.AWAITING_KV, SequenceStatus.SENDING, SequenceStatus.DRAINING})


class FinishReason(str, enum.Enum):
    """Why a request's output ends. A `str`, so the values travel as-is in JSON."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    # prefill only, two distinct steps of the hand-off to the decode worker:
    KV_PENDING = "kv_pending"  # the first token is sampled; the KV and it are about to be sent
    PREFILLED = "prefilled"    # the KV and first token were written: this worker's part is done

    def __str__(self) -> str:
        return self.value


class KVRole(str, enum.Enum):
    """Where a request's KV cache comes from and goes to (see scheduler.plan.NewRequest)."""

    LOCAL = "local"      # prefill and decode here
    PREFILL = "prefill"  # prefill here, then hand the KV to a decode worker
    DECODE = "decode"    # the KV arrives from a prefill worker into blocks allocated now

    @classmethod
    def of_worker(cls, role: str) -> KVRole:
        """The KV role of a worker's requests, from the worker's role (prefill | decode | both)."""
        try:
            return {"both": cls.LOCAL, "prefill": cls.PREFILL, "decode": cls.DECODE}[role]
        except KeyError:
            raise ValueError(f"unknown worker role {role!r}") from None


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and the top-N alternatives at one position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Sequence:
    """A request being served. `num_computed` tokens of `token_ids` have their KV in the cache."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_len: int = 1 << 30  # the model's context length: prompt + output never exceeds it
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    # rank 0, when params.prompt_logprobs is set: one per prompt token computed so far (the
    # first None: nothing precedes it); filled chunk by chunk by the model runner
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    kv: KVRole = KVRole.LOCAL
    grammar: GrammarState | None = None  # rank 0's matcher of a constrained request (sampler.py)
    # prefix cache: the names of the full blocks (block_names.py), extended as needed; how
    # many leading tokens' blocks are named in the cache; tokens the first schedule reused
    block_hashes: list[bytes] = field(default_factory=list)
    num_named: int = 0
    cached_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def generated_ids(self) -> list[int]:
        """This choice's output as sampling reads it: the tokens an earlier attempt output (the
        prompt's last ``params.resumed_tokens``), then this one's."""
        k = self.params.resumed_tokens
        return self.prompt_ids[len(self.prompt_ids) - k:] + self.output_ids if k else self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are still to be computed: asked for, and no token sampled yet
        (a recompute after preemption computes them again only before the first token)."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not yet computed (the whole prompt at first, then one per decode)."""
        return self.num_tokens - self.num_computed

    def stop_reason(self, token: int, num_outputs: int) -> FinishReason | None:
        """Why generation ends once `token` is the `num_outputs`-th output."""
        n = num_outputs
        if self.kv is KVRole.PREFILL:
            return FinishReason.KV_PENDING  # the first token travels with the KV to the decode worker
        if n >= self.params.min_tokens:
            if not self.params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
            if token in self.params.stop_token_ids:
                return FinishReason.STOP
        if n >= self.params.max_tokens or len(self.prompt_ids) + n >= self.max_len:
            return FinishReason.LENGTH
        return None
