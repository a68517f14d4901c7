"""Paged attention on the CUDA kernels of csrc/ (FA2 varlen prefill, split-KV paged decode).

Same signature and result as `attention.paged_attention` (the reference it is tested against).
Decode-only batches read the paged cache in place; batches with prefill chunks gather each
sequence's context (its cached prefix and its new tokens) into one varlen K/V, since the prefill
kernel takes contiguous keys; its causal mask is bottom-right aligned, which is what a chunk
after a cached prefix needs. The kernels take bfloat16 and head_dim 64 or 128 (checked when
the backend is chosen for bfloat16; per call for the head size: another head size runs the
reference, with a warning once).
"""
from __future__ import annotations

import functools
import logging

import torch

from . import cuda_lib
from .attention import gather_kv, paged_attention

logger = logging.getLogger(__name__)
from .dispatch import Availability

HEAD_DIMS = (64, 128)


def availability(dtype: torch.dtype) -> Availability:
    """The CUDA library is built, loads, has code for this GPU, and the model is bfloat16."""
    avail = cuda_lib.available()
    if not avail:
        return avail
    if dtype != torch.bfloat16:
        return Availability(False, f"the CUDA kernels take bfloat16; the model runs in {dtype}",
                            avail.capability)
    return Availability(True, f"{cuda_lib.library_path()} on sm_{avail.capability[0]}{avail.capability[1]}",
                        avail.capability)


def supports(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype == torch.bfloat16 and q.shape[-1] in HEAD_DIMS


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def paged_attention_cuda(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         query_start_loc: list[int], context_lens: list[int],
                         block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of new tokens over the paged cache (which already holds them)."""
    if not supports(q):
        _warn_once(q)
        return paged_attention(q, k_cache, v_cache, query_start_loc, context_lens, block_tables, scale)
    num_seqs = len(context_lens)
    dev = q.device
    q = q.contiguous()
    if num_seqs and query_start_loc[-1] == num_seqs:  # one query per sequence: paged decode
        lens = torch.tensor(context_lens, dtype=torch.int32, device=dev)
        splits = cuda_lib.default_decode_splits(num_seqs, k_cache.shape[2], q.shape[1] // k_cache.shape[2],
                                                max(context_lens), _num_sms(dev.index or 0))
        return cuda_lib.attn_decode(q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(), lens,
                                    scale, num_splits=splits)
    k = torch.cat([gather_kv(k_cache, block_tables[i], n) for i, n in enumerate(context_lens)])
    v = torch.cat([gather_kv(v_cache, block_tables[i], n) for i, n in enumerate(context_lens)])
    cu_q = torch.tensor(query_start_loc, dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, *context_lens], dtype=torch.int32, device=dev).cumsum(0, dtype=torch.int32)
    max_q = max(b - a for a, b in zip(query_start_loc, query_start_loc[1:]))
    return cuda_lib.attn_prefill(q, k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, scale, causal=True)


@functools.lru_cache(maxsize=None)
def _warn_once_for(shape: tuple[int, str]) -> None:
    logger.warning("CUDA attention kernels: head_dim %d / %s not supported (they take bfloat16 and "
                   "head_dim in %s); this layer attends with the torch reference", *shape, HEAD_DIMS)


def _warn_once(q: torch.Tensor) -> None:
    _warn_once_for((q.shape[-1], str(q.dtype)))
