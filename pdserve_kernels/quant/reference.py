"""Torch references of the block formats: dequantize, quantize, and the matmuls.

`qmatmul_torch` is the reference (and the fallback on any device): dequantize, then an fp32
matmul. `qmatmul_emulated` models the native CPU kernel exactly: activations quantized to int8
per block of 32 as the kernel does, then both operands dequantized; the two differ by the
activation rounding only, at most amax(block) / 254 per activation element.
"""
from __future__ import annotations

import torch

from .formats import BLOCK, Q4_0, Q4_1, Q8_0, BlockFormat


def _blocks(raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    if raw.dtype != torch.uint8 or raw.shape[-1] % fmt.block_bytes:
        raise ValueError(f"{fmt.name} blocks must be uint8 with a multiple of {fmt.block_bytes} "
                         f"bytes a row, got {raw.dtype} {tuple(raw.shape)}")
    return raw.reshape(*raw.shape[:-1], raw.shape[-1] // fmt.block_bytes, fmt.block_bytes)


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    return b[..., at:at + 2].contiguous().view(torch.float16).to(torch.float32)


def dequantize(raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """fp32 [..., K] from rows of blocks uint8 [..., K/32 * block_bytes]."""
    b = _blocks(raw, fmt)
    d = _half(b, 0)
    if fmt is Q8_0:
        w = b[..., 2:].contiguous().view(torch.int8).to(torch.float32) * d
    else:
        qs = b[..., 4:] if fmt is Q4_1 else b[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.float32)
        w = q * d + _half(b, 2) if fmt is Q4_1 else (q - 8.0) * d
    return w.reshape(*raw.shape[:-1], -1)


def quantize(w: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Rows of blocks uint8 [..., K/32 * block_bytes] of fp32-castable `w` [..., K], as llama.cpp
    quantizes (Q8_0: d = amax/127; Q4_0: d = -max/8 with max the signed value of largest
    magnitude; Q4_1: d = (max - min)/15, m = min)."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"{fmt.name}: {w.shape[-1]} input features are not a multiple of {BLOCK}")
    x = w.to(torch.float32).reshape(*w.shape[:-1], -1, BLOCK)
    if fmt is Q8_0:
        d = x.abs().amax(-1, keepdim=True) / 127.0
        q = torch.round(x * _inverse(d)).to(torch.int8).view(torch.uint8)
        parts = [_f16_bytes(d), q]
    elif fmt is Q4_0:
        idx = x.abs().argmax(-1, keepdim=True)
        d = x.gather(-1, idx) / -8.0
        q = torch.clamp(torch.trunc(x * _inverse(d) + 8.5), 0, 15).to(torch.uint8)
        parts = [_f16_bytes(d), _pack(q)]
    elif fmt is Q4_1:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15.0
        q = torch.clamp(torch.trunc((x - lo) * _inverse(d) + 0.5), 0, 15).to(torch.uint8)
        parts = [_f16_bytes(d), _f16_bytes(lo), _pack(q)]
    else:
        raise ValueError(f"unknown block format {fmt}")
    return torch.cat(parts, dim=-1).reshape(*w.shape[:-1], -1)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1.0 / d, torch.zeros_like(d))


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).contiguous().view(torch.uint8)


def _pack(q: torch.Tensor) -> torch.Tensor:
    return q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the native kernel does to its input: int8 q [M, K] and scales d [M, K/32] with
    d = amax/127 and q = round_half_even(x * (1/d)); x ≈ q * d."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"{x.shape[-1]} activation features are not a multiple of {BLOCK}")
    xb = x.to(torch.float32).reshape(*x.shape[:-1], -1, BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    q = torch.round(xb * _inverse(d))
    return q.reshape(x.shape).to(torch.int8), d.squeeze(-1)


def round_activations_int16(x: torch.Tensor) -> torch.Tensor:
    """What the int16-activation path multiplies: x rounded per block of 32 to d·q with
    d = amax/32767 and q = round_half_even(x * (1/d)), as fp32 (the native rounding, bit for bit)."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"{x.shape[-1]} activation features are not a multiple of {BLOCK}")
    xb = x.to(torch.float32).reshape(*x.shape[:-1], -1, BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 32767.0
    return (torch.round(xb * _inverse(d)) * d).reshape(x.shape)


def qmatmul_torch(x: torch.Tensor, raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The reference: x [M, K] @ dequantize(raw)^T in fp32 (any device)."""
    return x.to(torch.float32) @ dequantize(raw, fmt).T


def qmatmul_emulated(x: torch.Tensor, raw: torch.Tensor, fmt: BlockFormat,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The native kernel's arithmetic in `dtype`: activations quantized per block first."""
    q, d = quantize_activations(x)
    xq = (q.to(dtype).reshape(*q.shape[:-1], -1, BLOCK) * d.to(dtype)[..., None]).reshape(q.shape)
    return xq @ dequantize(raw, fmt).to(dtype).T
