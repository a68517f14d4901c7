"""NVFP4 quantization of weights (ModelOpt checkpoint form) and of activations (static scale).

Both produce packed E2M1 bytes plus row-major E4M3 block scales; swizzling for the SM120 GEMM
is a separate step (`swizzle.py`) because checkpoints store the row-major form.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .e2m1 import e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles
from .scales import BLOCK, activation_block_scales, weight_block_scales, weight_scale_2


class QuantizedWeight(NamedTuple):
    """One linear layer as a ModelOpt NVFP4 checkpoint stores it."""

    weight: torch.Tensor  # uint8 [out, in/2]
    weight_scale: torch.Tensor  # float8_e4m3fn [out, in/16], row-major
    weight_scale_2: torch.Tensor  # float32 scalar


class QuantizedActivation(NamedTuple):
    """Activations as the GEMM consumes them (before scale swizzling)."""

    data: torch.Tensor  # uint8 [m, k/2]
    scale: torch.Tensor  # float8_e4m3fn [m, k/16], row-major


def _blockwise(x: torch.Tensor, per_block: torch.Tensor) -> torch.Tensor:
    """Broadcast [.., K/16] to [.., K] along the last dimension."""
    return per_block.repeat_interleave(BLOCK, dim=-1)


def quantize_weight(w: torch.Tensor) -> QuantizedWeight:
    """W [out, in] -> (packed, weight_scale, weight_scale_2) with ModelOpt's formulas.

    Non-finite weights are rejected (ValueError): they mean a broken checkpoint.
    """
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"weight must be [out, in] with in % {BLOCK} == 0, got {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("weight contains NaN or inf")
    w32 = w.to(torch.float32)
    scale_2 = weight_scale_2(w32)
    scale = weight_block_scales(w32, scale_2)
    denom = scale.to(torch.float32) * scale_2
    codes = e2m1_encode(w32 / _blockwise(w32, denom))
    return QuantizedWeight(pack_nibbles(codes), scale, scale_2.reshape(()))


def quantize_activation(x: torch.Tensor, input_scale: torch.Tensor | float) -> QuantizedActivation:
    """x [m, k] -> E2M1 data + E4M3 scales with a static input_scale (gs = 1 / input_scale).

    Per block `SF = e4m3(gs * amax / 6)` and `x_q = e2m1(x * (gs / SF))`, all in fp32, with
    x_q = 0 where SF rounds to 0. This order of fp32 operations is the one the CUDA kernel
    uses, so both give the same bytes. ±inf saturates to ±6; NaN raises ValueError.
    """
    gs = 1.0 / torch.as_tensor(input_scale, dtype=torch.float32, device=x.device)
    return quantize_activation_gs(x, gs)


def quantize_activation_gs(x: torch.Tensor, gs: torch.Tensor) -> QuantizedActivation:
    """quantize_activation given gs = 1 / input_scale itself (the kernel's argument)."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"the last dimension must be a multiple of {BLOCK}")
    x32 = x.to(torch.float32)
    gs = torch.as_tensor(gs, dtype=torch.float32, device=x.device)
    sf = activation_block_scales(x32, gs)
    sf32 = sf.to(torch.float32)
    mult = torch.where(sf32 > 0, gs / sf32, torch.zeros_like(sf32))
    codes = e2m1_encode(x32 * _blockwise(x32, mult))
    return QuantizedActivation(pack_nibbles(codes), sf)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | float = 1.0
               ) -> torch.Tensor:
    """packed [.., k/2] + scale [.., k/16] (+ tensor scale) -> float32 [.., k].

    `code * scale` is exact in fp32 (at most 6 significant bits); the tensor scale rounds once.
    """
    values = e2m1_decode(unpack_nibbles(packed))
    blockwise = values * _blockwise(values, scale.to(torch.float32))
    return blockwise * torch.as_tensor(scale_2, dtype=torch.float32, device=packed.device)
