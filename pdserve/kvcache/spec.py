"""What a model caches per token and per layer.

Models declare their cache tensors (K and V per KV head for Llama; a compressed latent and an
index key for MLA + sparse attention), so the pool, the allocator and the KV transfer never
need to know a model's attention scheme.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheTensorSpec:
    """One tensor cached for every token of every layer, e.g. name="k", shape=(kv_heads, head_dim)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()
