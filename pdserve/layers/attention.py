"""Attention over the paged KV cache, and the per-step metadata every attention layer reads."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import pdserve_kernels as ops


@dataclass
class AttentionMetadata:
    """Where a step's new tokens go in the cache and what each sequence attends to.

    Tokens are flattened; sequence i owns tokens `query_start_loc[i]:query_start_loc[i+1]` and,
    after this step, `context_lens[i]` cached tokens reachable through `block_tables[i]`.
    """

    query_start_loc: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # int64 [num_seqs, max_blocks], padded with block 0
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    kv_caches: list[dict[str, torch.Tensor]]  # per layer: cache tensor name → [blocks, block_size, ...]


@dataclass
class SeqSpan:
    """One sequence of a step, for attention that reads its whole context from the cache:
    its query tokens, the cache slots of its context (this step's tokens included) and the
    causal mask `[n_queries, context]` (query at position p sees context tokens 0..p)."""

    queries: slice
    context_slots: torch.Tensor
    causal: torch.Tensor

    @property
    def context_len(self) -> int:
        return self.context_slots.shape[0]


def sequence_spans(meta: AttentionMetadata, positions: torch.Tensor, block_size: int) -> list[SeqSpan]:
    """The SeqSpans of a step (computed once per step, shared by every layer)."""
    spans = []
    for i, ctx in enumerate(meta.context_lens):
        pos = torch.arange(ctx, device=positions.device)
        slots = meta.block_tables[i, pos // block_size] * block_size + pos % block_size
        queries = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
        spans.append(SeqSpan(queries, slots, pos[None, :] <= positions[queries][:, None]))
    return spans


class Attention(nn.Module):
    """Stores this step's k/v in the paged cache of layer `layer_idx`, then attends."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # set while a prompt graph is captured: ends the graph's segment at this layer and gives
        # the buffer the next segment reads (engine/cuda_graphs.py, PromptGraphs)
        self.split: Callable[[Attention, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.split is not None:
            return self.split(self, q, k, v)
        return self.attend(q, k, v, meta)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`[tokens, heads * head_dim]`: k/v stored at the step's slots, then q attended."""
        cache = meta.kv_caches[self.layer_idx]
        ops.store_kv(cache["k"], cache["v"], k, v, meta.slot_mapping)
        out = ops.paged_attention(q, cache["k"], cache["v"], meta.query_start_loc,
                                  meta.context_lens, meta.block_tables, self.scale)
        return out.flatten(1)
