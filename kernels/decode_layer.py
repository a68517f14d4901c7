"""A decoder layer's decode step in two fused ops: the attention half and the MLP half.

`decode_attention_block`: `x += residual` (x becomes the residual stream), RMSNorm, the qkv
projection, rotate-half RoPE on q and k, k/v stored in the paged cache, paged decode attention,
the o projection. `decode_mlp_block`: `x += residual`, RMSNorm, gate/up, SwiGLU, down. Both
return the row-parallel projection's output before any tensor-parallel sum, so a caller with
TP > 1 all-reduces between them. Weights are GGUF block rows (pdserve_kernels.quant), one query
token per sequence, fp32.

The torch references compose the ops' own references (rms_norm, qmatmul_torch, store_kv,
paged_attention) and are what the native CPU variants (csrc/cpu/decode_block.cpp: one call per
block, no Python between the steps) are tested against.
"""
from __future__ import annotations

import torch

from . import cpu_lib
from .attention import paged_attention, store_kv
from .norm import rms_norm
from .quant import BlockFormat, PackedQ4, qmatmul_torch


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of `[T, heads, D]` with cos/sin `[T, D/2]`: the first half becomes
    x1·cos − x2·sin, the second x2·cos + x1·sin."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def decode_attention_block(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                           qkv_w: torch.Tensor, qkv_fmt: BlockFormat, o_w: torch.Tensor, o_fmt: BlockFormat,
                           cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, heads: int,
                           kv_heads: int, scale: float, qkv_packed: PackedQ4 | None = None,
                           o_packed: PackedQ4 | None = None) -> torch.Tensor:
    """The reference: x `[B, hidden]`, cos/sin `[B, head_dim/2]`, int64 slots/tables/lens
    (`*_packed`, the weights repacked for the native int16 path, are ignored here)."""
    B, d = x.shape[0], k_cache.shape[-1]
    h = rms_norm(x, residual, norm_w, eps)
    qkv = qmatmul_torch(h, qkv_w, qkv_fmt).view(B, heads + 2 * kv_heads, d)
    qk = rotate_halves(qkv[:, :heads + kv_heads], cos, sin)
    store_kv(k_cache, v_cache, qk[:, heads:], qkv[:, heads + kv_heads:], slots)
    att = paged_attention(qk[:, :heads], k_cache, v_cache, list(range(B + 1)), lens.tolist(), tables, scale)
    return qmatmul_torch(att.reshape(B, heads * d), o_w, o_fmt)


def decode_mlp_block(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                     gu_w: torch.Tensor, gu_fmt: BlockFormat, down_w: torch.Tensor, down_fmt: BlockFormat,
                     gu_packed: PackedQ4 | None = None, down_packed: PackedQ4 | None = None) -> torch.Tensor:
    """The reference: gate rows first in `gu_w`, then up rows (`*_packed` ignored)."""
    h = rms_norm(x, residual, norm_w, eps)
    gate, up = qmatmul_torch(h, gu_w, gu_fmt).chunk(2, dim=-1)
    return qmatmul_torch(torch.nn.functional.silu(gate) * up, down_w, down_fmt)


def _fp32_rows(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())
               for t in tensors)


def decode_attention_block_cpu(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor,
                               eps: float, qkv_w: torch.Tensor, qkv_fmt: BlockFormat, o_w: torch.Tensor,
                               o_fmt: BlockFormat, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                               lens: torch.Tensor, heads: int, kv_heads: int, scale: float,
                               qkv_packed: PackedQ4 | None = None, o_packed: PackedQ4 | None = None
                               ) -> torch.Tensor:
    """One native call (same arguments and result as the reference; packed weights, when given,
    multiply every row, so that a row's result never depends on the batch's size); other
    layouts run the reference."""
    ints = (slots, tables, lens)
    if not (_fp32_rows(x, residual, norm_w, cos, sin, k_cache, v_cache)
            and all(t.dtype == torch.int64 and t.stride(-1) == 1 for t in ints)
            and qkv_w.dtype == o_w.dtype == torch.uint8 and qkv_w.is_contiguous() and o_w.is_contiguous()
            and k_cache.shape[-2] == kv_heads and k_cache.shape[-1] % 2 == 0):
        return decode_attention_block(x, residual, norm_w, eps, qkv_w, qkv_fmt, o_w, o_fmt, cos, sin,
                                      k_cache, v_cache, slots, tables, lens, heads, kv_heads, scale)
    out = torch.empty(x.shape[0], o_w.shape[0], dtype=torch.float32)
    return cpu_lib.decode_attention_block(x, residual, norm_w, eps, qkv_fmt.code, qkv_w, o_fmt.code, o_w,
                                          cos, sin, k_cache, v_cache, slots, tables, lens, heads, kv_heads,
                                          scale, out, qkv_packed, o_packed)


def decode_mlp_block_cpu(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                         gu_w: torch.Tensor, gu_fmt: BlockFormat, down_w: torch.Tensor, down_fmt: BlockFormat,
                         gu_packed: PackedQ4 | None = None, down_packed: PackedQ4 | None = None) -> torch.Tensor:
    """One native call (same arguments and result as the reference); other layouts run it."""
    if not (_fp32_rows(x, residual, norm_w) and gu_w.dtype == down_w.dtype == torch.uint8
            and gu_w.is_contiguous() and down_w.is_contiguous()):
        return decode_mlp_block(x, residual, norm_w, eps, gu_w, gu_fmt, down_w, down_fmt)
    out = torch.empty(x.shape[0], down_w.shape[0], dtype=torch.float32)
    inter = gu_w.shape[0] // 2
    return cpu_lib.decode_mlp_block(x, residual, norm_w, eps, gu_fmt.code, gu_w, down_fmt.code, down_w,
                                    inter, out, gu_packed, down_packed)
