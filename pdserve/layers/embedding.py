"""Token embedding (replicated) and the LM head (vocab-parallel).

The embedding is a lookup, cheap to replicate, and replicating it avoids a collective per step.
The LM head is a large matmul: each rank computes logits for its slice of the vocabulary and
one all_gather assembles them. With tied weights the head is a view of the embedding rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed import TPGroup


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def load(self, param: str, source, name: str, shard_id: object = None) -> None:
        self.weight.data.copy_(source.get_slice(name, 0, 0, self.weight.shape[0], self.weight.dtype))


class LMHead(nn.Module):
    """Hidden states → logits over the full vocabulary, computed vocab-parallel."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup = TPGroup(),
                 tied_to: Embedding | None = None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, self.stop = _vocab_range(vocab_size, tp)
        if tied_to is not None:
            self.tied_to = [tied_to]  # a list so the embedding is not registered twice
            self.weight = None
        else:
            self.tied_to = []
            self.weight = nn.Parameter(torch.empty(self.stop - self.start, dim), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.tied_to[0].weight[self.start:self.stop] if self.tied_to else self.weight
        logits = F.linear(hidden, weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)[..., :self.vocab_size]
        return logits

    def load(self, param: str, source, name: str, shard_id: object = None) -> None:
        self.weight.data.copy_(source.get_slice(name, 0, self.start, self.stop, self.weight.dtype))


def _vocab_range(vocab: int, tp: TPGroup) -> tuple[int, int]:
    """Equal slices (the last may be short), so all_gather sees same-sized parts after padding."""
    part = -(-vocab // tp.size)
    return min(tp.rank * part, vocab), min((tp.rank + 1) * part, vocab)
