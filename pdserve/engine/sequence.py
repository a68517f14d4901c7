"""One request's state inside a worker: its tokens, its cache blocks, its progress."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # queued, or preempted (its cache dropped, to be recomputed)
    RUNNING = "running"    # holds blocks, is prefilling or decoding
    HELD = "held"          # holds blocks for a KV transfer (decode: arriving; prefill: leaving)
    FINISHED = "finished"


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
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    generator: torch.Generator | None = None
    kv: str = "local"  # "local" | "prefill" | "decode" (see scheduler.plan.NewRequest)

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not yet computed (the whole prompt at first, then one per decode)."""
        return self.num_tokens - self.num_computed

    def stop_reason(self, token: int, num_outputs: int) -> str | None:
        """Why generation ends once `token` is the `num_outputs`-th output ("stop" / "length")."""
        n = num_outputs
        if self.kv == "prefill":
            return "prefilled"  # the first token travels with the KV to the decode worker
        if n >= self.params.min_tokens:
            if not self.params.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in self.params.stop_token_ids:
                return "stop"
        if n >= self.params.max_tokens or len(self.prompt_ids) + n >= self.max_len:
            return "length"
        return None
