"""The tensor-parallel group a model's layers shard over."""
from __future__ import annotations

from dataclasses import dataclass, field

from .trace import CollectiveTrace

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """Rank and size of this process in its TP group; `size == 1` means no communication.

    `trace` records every collective the model enters (divergence checks compare them).
    """

    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup for the model's collectives
    trace: CollectiveTrace = field(default_factory=CollectiveTrace, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.trace.record("all_reduce")
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        self.trace.record("all_gather")
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x` of rank `src` on every rank (in place)."""
        if self.size > 1:
            self.trace.record("broadcast_tokens")
            dist.broadcast(x, src=src, group=self.group)
        return x

    def shard(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of `n` items split evenly (n must divide)."""
        if n % self.size:
            raise ValueError(f"{n} is not divisible by the TP size {self.size}")
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part
