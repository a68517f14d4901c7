"""Paged attention on the native CPU kernels of csrc/cpu (fp32 queries; fp32 or fp16 K/V).

Same signature and result as `attention.paged_attention` (the reference it is tested against).
K/V are read in place from the paged cache through the block tables, every sequence and KV head
in one call (no gather, no mask tensor):

* a decode-only batch (one new token per sequence): the decode kernel (attention_avx2.cpp);
* any other batch (prefill chunks, new tokens over a cached prefix, mixed with decode tokens):
  the extend kernel (extend_attention_*.cpp, AVX2 or AVX-512);
* other dtypes or devices: the reference.
"""
from __future__ import annotations

import torch

from . import cpu_lib
from .attention import paged_attention

# (block_tables, context_lens, query_start_loc, int64 lens, contiguous tables, int64 starts): every
# layer of a step passes the same tables tensor and lists, so they become tensors once per step
_step_memo: tuple[torch.Tensor, list[int], list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: list[int], context_lens: list[int],
                        block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of new tokens over the paged cache (which already holds them)."""
    num_seqs = len(context_lens)
    if not (num_seqs and q.dtype == torch.float32 and cpu_lib.cache_is_half(k_cache, v_cache) is not None
            and q.device.type == "cpu" and q.shape[-1] == k_cache.shape[-1]):
        return paged_attention(q, k_cache, v_cache, query_start_loc, context_lens, block_tables, scale)
    lens, tables, starts = _step_tensors(block_tables, context_lens, query_start_loc)
    if q.stride()[1:] != (q.shape[2], 1):
        q = q.contiguous()
    if query_start_loc[-1] == num_seqs:
        return cpu_lib.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    return cpu_lib.paged_extend_attention(q, k_cache, v_cache, tables, lens, starts, scale)


def _step_tensors(block_tables: torch.Tensor, context_lens: list[int],
                  query_start_loc: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    global _step_memo
    memo = _step_memo
    if memo is not None and memo[0] is block_tables and memo[1] == context_lens and memo[2] == query_start_loc:
        return memo[3], memo[4], memo[5]
    lens = torch.tensor(context_lens, dtype=torch.int64)
    starts = torch.tensor(query_start_loc, dtype=torch.int64)
    tables = block_tables.to(torch.int64)
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    _step_memo = (block_tables, list(context_lens), list(query_start_loc), lens, tables, starts)
    return lens, tables, starts
