"""The int16-activation path (csrc/cpu/qgemv_packed_avx512.cpp; the packed GEMV for few rows,
the fp32 paths on rounded rows for more) against its reference (activations rounded per block,
then dequantize-then-matmul) and against the fp32 product, and the repacking against the GGUF
blocks.

Bounds, and why: the native rounding is the reference's bit for bit (the same fp32 operations).
Against the reference only summation differs: the integer block sums are exact, and the fp32
scaling and summation of K/32 block terms add ≈ (K/32 + 3) · 2⁻²⁴ relative: 1e-5 · Σₖ |x_k W[n,k]|.
Against the unrounded fp32 product: each activation moves by at most d / 2 = amax / 65534 of its
block (d = amax / 32767), so output n moves by Σₖ |W[n,k]| · amax(block of k) / 65534 more.
"""
from __future__ import annotations

import pytest
import torch

from pdserve_kernels import cpu_lib
from pdserve_kernels.quant import (Q4_0, Q4_1, dequantize, pack_q4, qmatmul_packed_cpu, qmatmul_torch, quantize,
                                   round_activations_int16)

pytestmark = pytest.mark.skipif(not cpu_lib.isa_supported("avx512"),
                                reason="the packed path is AVX-512 only (AVX2 CPUs keep the fp32 path)")


def _rounding(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    amax = x.abs().view(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=-1)  # [M, K]
    return (amax / 65534) @ w.abs().T


def _summation(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return 1e-5 * (x.abs() @ w.abs().T)


def _activations(g: torch.Generator, m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=g) * torch.rand(k, generator=g) * 4  # uneven channel scales
    x[:, :32] = 0.0  # an all-zero activation block (scale 0)
    return x


def test_native_rounding_is_the_reference_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    x = _activations(g, 7, 192)
    x[3, 40] = 1e-30  # a denormal-scale block beside ordinary ones
    assert torch.equal(cpu_lib.round_int16(x), round_activations_int16(x))


@pytest.mark.parametrize("fmt", [Q4_0, Q4_1])
@pytest.mark.parametrize("m,n,k", [(1, 37, 96), (2, 100, 160), (1, 16, 32), (3, 23, 576), (5, 23, 576),
                                   (17, 40, 96), (70, 33, 64)])
def test_int16_path_equals_its_reference_and_stays_within_the_rounding_bound(fmt, m, n, k):
    """Rows below four take the packed GEMV, more the fp32 dot or panel path on rounded rows,
    from 64 the GEMM on rounded rows: every route multiplies the same rounded activations."""
    g = torch.Generator().manual_seed(m * n + k)
    raw = quantize(torch.randn(n, k, generator=g) * 0.1, fmt)
    x = _activations(g, m, k)
    packed = pack_q4(raw, fmt)
    y = qmatmul_packed_cpu(x, raw, fmt, packed)
    w = dequantize(raw, fmt)
    assert ((y - qmatmul_torch(round_activations_int16(x), raw, fmt)).abs() <= _summation(x, w)).all()
    assert ((y - qmatmul_torch(x, raw, fmt)).abs() <= _rounding(x, w) + _summation(x, w)).all()


@pytest.mark.parametrize("fmt", [Q4_0, Q4_1])
def test_packing_keeps_every_weight(fmt):
    """Unpacking qs and dm gives the dequantized GGUF weights bit for bit (odd block count: the
    padding block is zero)."""
    g = torch.Generator().manual_seed(3)
    raw = quantize(torch.randn(7, 96, generator=g), fmt)  # 3 blocks a row: one padding block
    qs, dm = pack_q4(raw, fmt)
    nbp = dm.shape[1] // 2
    q = torch.stack((qs & 0x0F, qs >> 4), dim=2).view(7, nbp // 2, 32, 2).permute(0, 1, 3, 2).reshape(7, nbp, 32)
    w = q.float() * dm[:, :nbp, None] + dm[:, nbp:, None]
    assert torch.equal(w[:, :3].reshape(7, 96), dequantize(raw, fmt))
    assert torch.equal(w[:, 3], torch.zeros(7, 32))
