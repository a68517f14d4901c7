"""Rotary position embeddings: the rotate-half convention of Hugging Face Llama and DeepSeek's
interleaved pairs, with linear, llama3 and yarn scaling."""
from __future__ import annotations

import math

import torch
from torch import nn

import pdserve_kernels as ops


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, adjusted by `rope_scaling` (types: default, linear, llama3, yarn)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: interpolate the slow frequencies by `factor`, keep the fast ones, ramp in between."""
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(scaling: dict | None) -> float:
    """YaRN's magnitude correction, applied to cos and sin (1 for every other type)."""
    if (scaling or {}).get("rope_type", (scaling or {}).get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q `[T, H, D]` and k `[T, KVH, D]` at the given positions.

    `interleaved`: DeepSeek's layout, where dims (0,1), (2,3)... are the rotated pairs. The output
    is de-interleaved (rotated evens, then rotated odds), as in transformers: q·k is unchanged
    because q and k get the same permutation.

    cos and sin come from a table over positions (grown on demand, never recomputed per layer),
    and a step's rows of it are kept for the positions tensor they were read for: one module is
    shared by every layer of a model, so a step reads the table once. The values are those of
    computing `cos(position * inv_freq)` directly, bit for bit.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None, interleaved: bool = False):
        super().__init__()
        # a plain attribute, not a buffer: model.to(bf16) must not round the frequencies
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.factor = rope_attention_factor(scaling)
        self.interleaved = interleaved
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [positions, D/2]
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # positions, cos, sin
        self._covered = False  # the table covers every position a step can hold (cover())

    def cover(self, positions: int, device: torch.device | str) -> None:
        """Build the table for positions `0..positions-1` now and never check a step against it
        again (the engine passes its context length). Checking reads the step's largest position
        back to the host: on a GPU that waits for the queued kernels, and a CUDA graph cannot
        capture it (engine/cuda_graphs.py)."""
        self._table = self._build(positions, torch.device(device))
        self._covered = True

    def _build(self, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(size, device=device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
        return freqs.cos() * self.factor, freqs.sin() * self.factor

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin `[T, 1, D/2]` at `positions` (attention factor applied)."""
        if self._step is not None and self._step[0] is positions:
            return self._step[1], self._step[2]
        table = self._table
        if not (self._covered and table is not None and table[0].device == positions.device):
            need = int(positions.max()) + 1 if positions.numel() else 1
            if table is None or table[0].shape[0] < need or table[0].device != positions.device:
                size = 1 << max(need - 1, 255).bit_length()  # a power of two: few regrowths
                table = self._table = self._build(size, positions.device)
                self._covered = False
        cos, sin = table[0][positions][:, None, :], table[1][positions][:, None, :]
        self._step = (positions, cos, sin)  # holds `positions`, so its identity is not reused
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        if self.interleaved:
            return _rotate_pairs(q, cos, sin), _rotate_pairs(k, cos, sin)
        return ops.rotate_halves(q, cos, sin), ops.rotate_halves(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """RoPE on `[T, heads, D]` in one pass: q and k heads side by side rotate together."""
        cos, sin = self.cos_sin(positions)
        return _rotate_pairs(x, cos, sin) if self.interleaved else ops.rotate_halves(x, cos, sin)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1).to(x.dtype)
