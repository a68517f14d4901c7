"""The packed int16-activation GEMV (csrc/cpu/qgemv_packed_avx512.cpp, batch-1 decode on
AVX-512) against dequantize-then-matmul, and the repacking against the GGUF blocks.

Bound, and why: activations are rounded to int16 per block of 32 (d = amax / 32767, round to
nearest), so each differs from the fp32 value by at most d / 2 = amax / 65534; the integer block
sums are exact, and the fp32 scaling and summation of K/32 block terms add ≈ (K/32 + 3) · 2⁻²⁴
relative. Output n may therefore move by Σₖ |W[n,k]| · amax(block of k) / 65534 plus 1e-5 ·
Σₖ |x_k W[n,k]|; the test asserts exactly that per element.
"""
from __future__ import annotations

import pytest
import torch

from pdserve_kernels import cpu_lib
from pdserve_kernels.quant import Q4_0, Q4_1, dequantize, pack_q4, qmatmul_torch, quantize

pytestmark = pytest.mark.skipif(not cpu_lib.isa_supported("avx512"),
                                reason="the packed path is AVX-512 only (AVX2 CPUs keep the fp32 path)")


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    amax = x.abs().view(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=-1)  # [M, K]
    return (amax / 65534) @ w.abs().T + 1e-5 * (x.abs() @ w.abs().T)


@pytest.mark.parametrize("fmt", [Q4_0, Q4_1])
@pytest.mark.parametrize("m,n,k", [(1, 37, 96), (2, 100, 160), (1, 16, 32), (5, 23, 576)])
def test_packed_gemv_within_the_int16_rounding_bound(fmt, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    raw = quantize(torch.randn(n, k, generator=g) * 0.1, fmt)
    x = torch.randn(m, k, generator=g) * torch.rand(k, generator=g) * 4  # uneven channel scales
    x[:, :32] = 0.0  # an all-zero activation block (scale 0)
    packed = pack_q4(raw, fmt)
    y = cpu_lib.qmatmul_packed(x, packed.qs, packed.dm, n, k)
    w = dequantize(raw, fmt)
    assert ((y - qmatmul_torch(x, raw, fmt)).abs() <= _bound(x, w)).all()


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
