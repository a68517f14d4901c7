"""E4M3 block scales and the FP32 tensor scale, with NVIDIA ModelOpt's formulas.

One unsigned E4M3 scale per 16 consecutive elements along K, and one FP32 scale per tensor.
Scales are stored as `torch.float8_e4m3fn`; conversions clamp first so they saturate the same
way on every torch version (the hardware converts with `.satfinite`).
"""
from __future__ import annotations

import torch

BLOCK = 16
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
FP4_E4M3_RANGE = 6.0 * 448.0  # amax that maps to the largest E2M1 value times the largest scale


def to_e4m3(x: torch.Tensor, min_value: float = 0.0) -> torch.Tensor:
    """Non-negative float32 -> float8_e4m3fn, round-to-nearest-even, saturating at 448."""
    return x.to(torch.float32).clamp(min=min_value, max=E4M3_MAX).to(torch.float8_e4m3fn)


def block_amax(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., K/16]: max |x| of each 16-element block along the last dimension."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be a multiple of {BLOCK}")
    blocks = x.to(torch.float32).abs().unflatten(-1, (-1, BLOCK))
    return blocks.amax(dim=-1)


def weight_scale_2(w: torch.Tensor) -> torch.Tensor:
    """Per-tensor FP32 scale `amax(W) / (6 * 448)`; an all-zero tensor gets 1.0 (any works)."""
    amax = w.to(torch.float32).abs().amax()
    scale = amax / FP4_E4M3_RANGE
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def weight_block_scales(w: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """`e4m3(block_amax / (6 * weight_scale_2))`, clamped below at 2^-9 (no zero scales)."""
    return to_e4m3(block_amax(w) / (6.0 * scale_2), min_value=E4M3_MIN_SUBNORMAL)


def input_scale_from_amax(calib_amax: float | torch.Tensor) -> torch.Tensor:
    """Static activation scale from calibration: `calib_amax / (6 * 448)`."""
    return torch.as_tensor(calib_amax, dtype=torch.float32) / FP4_E4M3_RANGE


def activation_block_scales(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """`SF = e4m3_satfinite((block_amax * gs) / 6)` with gs = 1 / input_scale, in fp32."""
    return to_e4m3(block_amax(x) * gs.to(torch.float32) / 6.0)
