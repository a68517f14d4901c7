"""Paged attention, torch reference: works on any device, used by every CPU test.

The paged KV cache of one layer is a pair of tensors `[num_blocks, block_size, kv_heads, head_dim]`.
A batch is a flat list of new tokens, grouped per sequence (`query_start_loc`); each sequence
attends causally to its whole context (`context_lens`, cached tokens + new ones) through its
block table. Decode-only batches (one new token per sequence) take a gathered, batched path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new keys/values `[T, kv_heads, head_dim]` into their cache slots (block * size + offset)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence, `[length, kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:n_blocks]].flatten(0, 1)[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: list[int], context_lens: list[int], block_tables: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of new tokens over the paged cache (which already holds them).

    q: `[T, heads, head_dim]`; returns `[T, heads, head_dim]`.
    """
    num_seqs = len(context_lens)
    if num_seqs and query_start_loc[-1] == num_seqs:
        return _decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale)
    out = torch.empty_like(q)
    for i in range(num_seqs):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        ctx = context_lens[i]
        k = gather_kv(k_cache, block_tables[i], ctx).transpose(0, 1)  # [kvh, ctx, d]
        v = gather_kv(v_cache, block_tables[i], ctx).transpose(0, 1)
        qi = q[start:end].transpose(0, 1)  # [h, n, d]
        n = end - start
        # query j sits at position ctx - n + j and may see keys 0..ctx - n + j
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
        o = F.scaled_dot_product_attention(qi.unsqueeze(0), k.unsqueeze(0).to(q.dtype),
                                           v.unsqueeze(0).to(q.dtype), attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      context_lens: list[int], block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence: gather every sequence's blocks at once and mask the padding."""
    block_size = k_cache.shape[1]
    max_len = max(context_lens)
    n_blocks = (max_len + block_size - 1) // block_size
    # index_select on the flat table: the same gather as k_cache[tables], without advanced
    # indexing's per-call overhead (it dominates at decode sizes)
    tables = block_tables[:, :n_blocks].reshape(-1)
    shape = (len(context_lens), n_blocks * block_size, *k_cache.shape[2:])
    k = k_cache.index_select(0, tables).view(shape).transpose(1, 2)  # [B, kvh, L, d]
    v = v_cache.index_select(0, tables).view(shape).transpose(1, 2)
    mask = _padding_mask(block_tables, context_lens, k.shape[2], q.device)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    return o.squeeze(2)


_mask_memo: tuple[torch.Tensor, list[int], torch.Tensor] | None = None


def _padding_mask(block_tables: torch.Tensor, context_lens: list[int], length: int,
                  device: torch.device) -> torch.Tensor:
    """`[B, 1, 1, L]` true where a key is inside its sequence. Every layer of a step passes the
    same `block_tables` tensor and lengths: the mask is built once per step, not per layer (the
    memo holds that tensor, so a later step's cannot be mistaken for it)."""
    global _mask_memo
    memo = _mask_memo
    if memo is not None and memo[0] is block_tables and memo[1] == context_lens \
            and memo[2].shape[-1] == length:
        return memo[2]
    lens = torch.tensor(context_lens, device=device)
    mask = (torch.arange(length, device=device)[None, :] < lens[:, None])[:, None, None, :]
    _mask_memo = (block_tables, list(context_lens), mask)
    return mask
