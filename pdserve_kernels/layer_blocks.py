"""A decoder layer's step in two fused ops: the attention half and the MLP half.

`attention_block`: `x += residual` (x becomes the residual stream), RMSNorm, the qkv
projection, rotate-half RoPE on q and k, k/v stored in the paged cache, paged attention, the o
projection. `mlp_block`: `x += residual`, RMSNorm, gate/up, SwiGLU, down. Both
return the row-parallel projection's output before any tensor-parallel sum, so a caller with
TP > 1 all-reduces between them. Weights are GGUF block rows (pdserve_kernels.quant), fp32
activations; any batch: one new token a sequence (decode) or several (prompt chunks, over a
cached prefix or not), mixed.

The torch references compose the ops' own references (rms_norm, qmatmul_torch, rotate_halves,
silu_and_mul, store_kv, paged_attention) and are what the native CPU variants
(csrc/cpu/layer_block.cpp: one call per block, no Python between the steps) are tested against.

`fused_layers`: every layer of a model without tensor-parallel sums (TP = 1), then the final
RMSNorm, as one op over a `LayerStack` (csrc/cpu/layer_stack.cpp: one native call a step).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import cpu_lib
from .attention import paged_attention, store_kv
from .layer_ops import rotate_halves, silu_and_mul
from .norm import rms_norm
from .quant import BlockFormat, Packed, qmatmul_torch, round_activations_int16


def _project(x: torch.Tensor, raw: torch.Tensor, fmt: BlockFormat, packed: Packed | None) -> torch.Tensor:
    """A projection's reference: a packed weight multiplies int16-rounded activations."""
    return qmatmul_torch(x if packed is None else round_activations_int16(x), raw, fmt)


def attention_block(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                    qkv_w: torch.Tensor, qkv_fmt: BlockFormat, o_w: torch.Tensor, o_fmt: BlockFormat,
                    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                    starts: torch.Tensor | None, heads: int, kv_heads: int, scale: float,
                    qkv_packed: Packed | None = None, o_packed: Packed | None = None) -> torch.Tensor:
    """The reference: x `[M, hidden]` (M token rows), cos/sin `[M, head_dim/2]`, int64 slots
    `[M]`, tables and lens (one row a sequence), starts `[B + 1]` (sequence b's rows
    `starts[b]:starts[b+1]`; None: one row a sequence); a projection given `*_packed` (the weight
    repacked for the native int16 path) multiplies activations rounded to int16 per block, as the
    native path does."""
    M, d = x.shape[0], k_cache.shape[-1]
    h = rms_norm(x, residual, norm_w, eps)
    qkv = _project(h, qkv_w, qkv_fmt, qkv_packed).view(M, heads + 2 * kv_heads, d)
    qk = rotate_halves(qkv[:, :heads + kv_heads], cos[:, None, :], sin[:, None, :])
    store_kv(k_cache, v_cache, qk[:, heads:], qkv[:, heads + kv_heads:], slots)
    rows = list(range(M + 1)) if starts is None else starts.tolist()
    att = paged_attention(qk[:, :heads], k_cache, v_cache, rows, lens.tolist(), tables, scale)
    return _project(att.reshape(M, heads * d), o_w, o_fmt, o_packed)


def mlp_block(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
              gu_w: torch.Tensor, gu_fmt: BlockFormat, down_w: torch.Tensor, down_fmt: BlockFormat,
              gu_packed: Packed | None = None, down_packed: Packed | None = None) -> torch.Tensor:
    """The reference: gate rows first in `gu_w`, then up rows (`*_packed` as above)."""
    h = rms_norm(x, residual, norm_w, eps)
    return _project(silu_and_mul(_project(h, gu_w, gu_fmt, gu_packed)), down_w, down_fmt, down_packed)


def _fp32_rows(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())
               for t in tensors)


def _caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """K/V caches the native blocks read: contiguous on the CPU, both fp32 or both fp16."""
    return (k_cache.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous()
            and cpu_lib.cache_is_half(k_cache, v_cache) is not None)


def _int64_rows(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.int64 and t.stride(-1) == 1) for t in tensors)


def attention_block_cpu(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor,
                        eps: float, qkv_w: torch.Tensor, qkv_fmt: BlockFormat, o_w: torch.Tensor,
                        o_fmt: BlockFormat, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                        lens: torch.Tensor, starts: torch.Tensor | None, heads: int, kv_heads: int,
                        scale: float, qkv_packed: Packed | None = None, o_packed: Packed | None = None
                        ) -> torch.Tensor:
    """One native call (same arguments and result as the reference; packed weights, when given,
    multiply every row, so that a row's result never depends on the batch's size); other
    layouts run the reference."""
    if not (_fp32_rows(x, residual, norm_w, cos, sin) and _caches(k_cache, v_cache)
            and _int64_rows(slots, tables, lens, starts)
            and qkv_w.dtype == o_w.dtype == torch.uint8 and qkv_w.is_contiguous() and o_w.is_contiguous()
            and k_cache.shape[-2] == kv_heads and k_cache.shape[-1] % 2 == 0):
        return attention_block(x, residual, norm_w, eps, qkv_w, qkv_fmt, o_w, o_fmt, cos, sin,
                               k_cache, v_cache, slots, tables, lens, starts, heads, kv_heads, scale,
                               qkv_packed, o_packed)
    out = torch.empty(x.shape[0], o_w.shape[0], dtype=torch.float32)
    return cpu_lib.attention_block(x, residual, norm_w, eps, qkv_fmt.code, qkv_w, o_fmt.code, o_w,
                                   cos, sin, k_cache, v_cache, slots, tables, lens, starts, heads,
                                   kv_heads, scale, out, qkv_packed, o_packed)


def mlp_block_cpu(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                  gu_w: torch.Tensor, gu_fmt: BlockFormat, down_w: torch.Tensor, down_fmt: BlockFormat,
                  gu_packed: Packed | None = None, down_packed: Packed | None = None) -> torch.Tensor:
    """One native call (same arguments and result as the reference); other layouts run it."""
    if not (_fp32_rows(x, residual, norm_w) and gu_w.dtype == down_w.dtype == torch.uint8
            and gu_w.is_contiguous() and down_w.is_contiguous()):
        return mlp_block(x, residual, norm_w, eps, gu_w, gu_fmt, down_w, down_fmt, gu_packed, down_packed)
    out = torch.empty(x.shape[0], down_w.shape[0], dtype=torch.float32)
    inter = gu_w.shape[0] // 2
    return cpu_lib.mlp_block(x, residual, norm_w, eps, gu_fmt.code, gu_w, down_fmt.code, down_w,
                             inter, out, gu_packed, down_packed)


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer as the fused layer blocks read it: its two norms' weights, the
    projections (qkv, o, gate_up, down) as GGUF block rows with their formats and packed copies
    (or None), and its K/V cache."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    fmts: tuple[BlockFormat, BlockFormat, BlockFormat, BlockFormat]
    packed: tuple[Packed | None, Packed | None, Packed | None, Packed | None]
    k_cache: torch.Tensor
    v_cache: torch.Tensor


@dataclass
class LayerStack:
    """A model's decoder layers for `fused_layers`, gathered once (the model keeps it while its
    KV cache stays the same tensors). `use_packed`: multiply by the packed copies where present."""

    layers: list[StackLayer]
    final_norm: torch.Tensor
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    scale: float
    use_packed: bool
    _table: torch.Tensor | None = field(default=None, repr=False)

    def table(self) -> torch.Tensor:
        """int64 [layers, 20]: per layer the addresses and formats the native call reads (the
        layout of `StackedLayer` in csrc/cpu/layer_stack.cpp); the tensors stay referenced here."""
        if self._table is None:
            rows = []
            for L in self.layers:
                packed = L.packed if self.use_packed else (None,) * 4
                rows.append([L.attn_norm.data_ptr(), L.mlp_norm.data_ptr(), *(w.data_ptr() for w in L.weights),
                            *(0 if p is None else p.qs.data_ptr() for p in packed),
                            *(0 if p is None else p.dm.data_ptr() for p in packed),
                            L.k_cache.data_ptr(), L.v_cache.data_ptr(), *(f.code for f in L.fmts)])
            self._table = torch.tensor(rows, dtype=torch.int64)
        return self._table


def fused_layers(x: torch.Tensor, stack: LayerStack, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: each layer's two blocks (their references), the residual stream carried as
    in `LlamaModel.forward`, then the final norm of (last output + residual). x `[B, hidden]` is
    consumed (written in place)."""
    residual = None
    for L in stack.layers:
        y = attention_block(x, residual, L.attn_norm, stack.eps, L.weights[0], L.fmts[0], L.weights[1],
                            L.fmts[1], cos, sin, L.k_cache, L.v_cache, slots, tables, lens, starts, stack.heads,
                            stack.kv_heads, stack.scale, *L.packed[:2])
        z = mlp_block(y, x, L.mlp_norm, stack.eps, L.weights[2], L.fmts[2], L.weights[3], L.fmts[3],
                      *L.packed[2:])
        x, residual = z, y
    return rms_norm(x, residual, stack.final_norm, stack.eps)


def fused_layers_cpu(x: torch.Tensor, stack: LayerStack, cos: torch.Tensor, sin: torch.Tensor,
                     slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                     starts: torch.Tensor | None = None) -> torch.Tensor:
    """One native call (the same result as the reference, bit for bit the per-layer native
    blocks'); layouts the kernel does not take run the reference."""
    first = stack.layers[0]
    if not (_fp32_rows(x, cos, sin, stack.final_norm) and _caches(first.k_cache, first.v_cache)
            and _int64_rows(slots, tables, lens, starts)
            and first.k_cache.shape[-2] == stack.kv_heads and stack.head_dim % 2 == 0):
        return fused_layers(x, stack, cos, sin, slots, tables, lens, starts)
    out = torch.empty_like(x)
    return cpu_lib.fused_layers(stack.table(), x, stack.final_norm, stack.eps, cos, sin, slots, tables, lens,
                                starts, stack.heads, stack.kv_heads, stack.head_dim, first.k_cache.shape[1],
                                stack.inter, stack.scale, out,
                                kv_half=bool(cpu_lib.cache_is_half(first.k_cache, first.v_cache)))
