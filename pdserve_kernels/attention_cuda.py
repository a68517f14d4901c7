"""Paged attention on the CUDA kernels of csrc/ (FA2 varlen prefill, split-KV paged decode).

Same signature and result as `attention.paged_attention` (the reference it is tested against).
Decode-only batches read the paged cache in place; batches with prefill chunks gather each
sequence's context (its cached prefix and its new tokens) into one varlen K/V, since the prefill
kernel takes contiguous keys; its causal mask is bottom-right aligned, which is what a chunk
after a cached prefix needs. The kernels take bfloat16 and head_dim 64 or 128 (checked when
the backend is chosen for bfloat16; per call for the head size: another head size runs the
reference, with a warning once).

Every layer of a step passes the same block tables and lengths, so what the launches read
besides the cache is built once per step, by its first layer: for decode the int32 lengths and
tables and the split count (`decode_inputs`); for prefill the offsets and one flat list of every
sequence's cache slots, from which each layer gathers its K and V with one index_select each
(`prefill_inputs`). Their copies to the device never wait for the stream: a blocking copy made
the host wait for the GPU once per layer (docs/gpu.md).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from . import cuda_lib
from .attention import paged_attention

from .dispatch import Availability

logger = logging.getLogger(__name__)

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
        step = decode_inputs(block_tables, context_lens, k_cache.shape[2], q.shape[1] // k_cache.shape[2])
        return cuda_lib.attn_decode(q, k_cache, v_cache, step.tables, step.lens, scale, num_splits=step.splits)
    step = prefill_inputs(block_tables, query_start_loc, context_lens, k_cache.shape[1])
    k = k_cache.flatten(0, 1).index_select(0, step.slots)  # every sequence's context, one after another
    v = v_cache.flatten(0, 1).index_select(0, step.slots)
    return cuda_lib.attn_prefill(q, k, v, step.cu_q, step.cu_k, step.max_q, scale, causal=True)


@dataclass(frozen=True)
class DecodeInputs:
    """What a step's paged decode launches read besides the cache, the same for every layer."""

    tables: torch.Tensor  # int32 [num_seqs, max_blocks], on the cache's device
    lens: torch.Tensor    # int32 [num_seqs]
    splits: int           # split-KV parts per sequence


# (block tables, lengths, int32 tables, device lengths) of the step being computed
_decode_memo: tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor] | None = None


def decode_inputs(block_tables: torch.Tensor, context_lens: list[int], num_kv_heads: int,
                  group: int) -> DecodeInputs:
    """The step's DecodeInputs: the device tensors are made by its first layer and reused by
    the others. The memo holds the step's `block_tables` tensor, so a later step's tables can
    never match it."""
    global _decode_memo
    memo = _decode_memo
    if memo is None or memo[0] is not block_tables or memo[1] != context_lens:
        # non_blocking from pageable memory: CUDA stages the list's bytes before returning, so
        # the host goes on launching instead of waiting for the kernels queued before the copy
        lens = torch.tensor(context_lens, dtype=torch.int32).to(block_tables.device, non_blocking=True)
        memo = _decode_memo = (block_tables, list(context_lens), block_tables.to(torch.int32).contiguous(), lens)
    dev = block_tables.device
    num_sms = _num_sms(dev.index or 0) if dev.type == "cuda" else 1
    splits = cuda_lib.default_decode_splits(len(context_lens), num_kv_heads, group, max(context_lens), num_sms)
    return DecodeInputs(memo[2], memo[3], splits)


@dataclass(frozen=True)
class PrefillInputs:
    """What a step's varlen prefill launches read besides the cache, the same for every layer."""

    slots: torch.Tensor  # int64 [sum of context lengths]: each sequence's cache slots, in order
    cu_q: torch.Tensor   # int32 [num_seqs + 1]: where each sequence's queries start
    cu_k: torch.Tensor   # int32 [num_seqs + 1]: where each sequence's gathered keys start
    max_q: int


# (block tables, query starts, lengths, inputs) of the step being computed
_prefill_memo: tuple[torch.Tensor, list[int], list[int], PrefillInputs] | None = None


def prefill_inputs(block_tables: torch.Tensor, query_start_loc: list[int], context_lens: list[int],
                   block_size: int) -> PrefillInputs:
    """The step's PrefillInputs, made by its first layer and reused by the others: then each
    layer gathers its K and V with one index_select each instead of one gather a sequence,
    and no layer waits on a blocking copy of the offsets."""
    global _prefill_memo
    memo = _prefill_memo
    if memo is not None and memo[0] is block_tables and memo[1] == query_start_loc and memo[2] == context_lens:
        return memo[3]
    dev, total = block_tables.device, sum(context_lens)
    starts = [0]
    for n in context_lens:
        starts.append(starts[-1] + n)
    # the copies never wait: CUDA stages the pageable bytes before returning
    lens = torch.tensor(context_lens, dtype=torch.int64).to(dev, non_blocking=True)
    firsts = torch.tensor(starts[:-1], dtype=torch.int64).to(dev, non_blocking=True)
    seq = torch.repeat_interleave(torch.arange(len(context_lens), device=dev), lens, output_size=total)
    pos = torch.arange(total, device=dev) - firsts[seq]  # position within its sequence
    slots = block_tables[seq, pos // block_size].to(torch.int64) * block_size + pos % block_size
    offsets = torch.tensor(query_start_loc + starts, dtype=torch.int32).to(dev, non_blocking=True)
    n = len(query_start_loc)
    step = PrefillInputs(slots, offsets[:n], offsets[n:],
                         max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])))
    _prefill_memo = (block_tables, list(query_start_loc), list(context_lens), step)
    return step


def use_decode_inputs(block_tables: torch.Tensor, context_lens: list[int], tables: torch.Tensor,
                      lens: torch.Tensor) -> None:
    """Make the decode launches of the step whose metadata holds `block_tables` and
    `context_lens` read `tables` (int32) and `lens` (int32, on the device): a CUDA graph's
    static inputs, which it refills before every replay (engine/cuda_graphs.py)."""
    global _decode_memo
    _decode_memo = (block_tables, list(context_lens), tables, lens)


@functools.lru_cache(maxsize=None)
def _warn_once_for(shape: tuple[int, str]) -> None:
    logger.warning("CUDA attention kernels: head_dim %d / %s not supported (they take bfloat16 and "
                   "head_dim in %s); this layer attends with the torch reference", *shape, HEAD_DIMS)


def _warn_once(q: torch.Tensor) -> None:
    _warn_once_for((q.shape[-1], str(q.dtype)))
