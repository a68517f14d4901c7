"""The int16-activation path (csrc/cpu/qgemv_packed_avx512.cpp, one kernel for every row count)
against its reference (activations rounded per block,
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
from pdserve_kernels.quant import (Q4_0, Q4_1, Q8_0, dequantize, pack, qmatmul_packed_cpu, qmatmul_torch,
                                   quantize, round_activations_int16)

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


@pytest.mark.parametrize("fmt", [Q4_0, Q4_1, Q8_0])
@pytest.mark.parametrize("m,n,k", [(1, 37, 96), (2, 100, 160), (1, 16, 32), (3, 23, 576), (5, 23, 576),
                                   (17, 40, 96), (70, 33, 64), (130, 50, 96)])
def test_int16_path_equals_its_reference_and_stays_within_the_rounding_bound(fmt, m, n, k):
    """Odd row counts (tiles of 4 and a tail), partial last panels, and more rows than one unit of
    work (64)."""
    g = torch.Generator().manual_seed(m * n + k)
    raw = quantize(torch.randn(n, k, generator=g) * 0.1, fmt)
    x = _activations(g, m, k)
    packed = pack(raw, fmt)
    y = qmatmul_packed_cpu(x, raw, fmt, packed)
    w = dequantize(raw, fmt)
    assert ((y - qmatmul_torch(round_activations_int16(x), raw, fmt)).abs() <= _summation(x, w)).all()
    assert ((y - qmatmul_torch(x, raw, fmt)).abs() <= _rounding(x, w) + _summation(x, w)).all()


@pytest.mark.parametrize("fmt", [Q4_1, Q8_0])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_gets_the_same_bits_alone_and_among_others(threads, fmt):
    """Every output sums its blocks in one order whatever the tile, the row count or the thread
    split (qgemv_packed.h): a decode row's result does not depend on its batch."""
    g = torch.Generator().manual_seed(11)
    raw = quantize(torch.randn(100, 576, generator=g) * 0.1, fmt)
    packed = pack(raw, fmt)
    x = _activations(g, 70, 576)
    together = cpu_lib.qmatmul_packed(fmt.code, x, packed.qs, packed.dm, 100, 576, threads)
    for rows in (slice(0, 1), slice(5, 7), slice(9, 12), slice(20, 25), slice(0, 70)):
        alone = cpu_lib.qmatmul_packed(fmt.code, x[rows], packed.qs, packed.dm, 100, 576, threads)
        assert torch.equal(alone, together[rows])


def test_packing_keeps_every_q8_weight():
    """Unpacking a packed Q8_0 matrix by the layout of qgemv_packed.h gives the dequantized GGUF
    weights bit for bit (23 rows: the last panel's missing rows are zero)."""
    g = torch.Generator().manual_seed(4)
    n, nb = 23, 3
    raw = quantize(torch.randn(n, nb * 32, generator=g), Q8_0)
    qs, dm = pack(raw, Q8_0)
    assert qs.shape == (2, nb * 512) and dm.shape == (2, nb * 16)
    q = qs.view(torch.int8).float()
    w = torch.empty(32, nb * 32)
    for p in range(2):
        for b in range(nb):
            for c in range(16):
                for j in range(32):
                    w[p * 16 + j // 2, b * 32 + 2 * c + j % 2] = q[p, b * 512 + c * 32 + j] * dm[p, b * 16 + j // 2]
    assert torch.equal(w[:n], dequantize(raw, Q8_0))
    assert torch.equal(w[n:], torch.zeros(32 - n, nb * 32))


@pytest.mark.parametrize("fmt", [Q4_0, Q4_1])
def test_packing_keeps_every_weight(fmt):
    """Unpacking qs and dm by the layout of qgemv_packed.h gives the dequantized GGUF weights bit
    for bit (23 rows: the last panel's missing rows are zero)."""
    g = torch.Generator().manual_seed(3)
    n, nb = 23, 3
    raw = quantize(torch.randn(n, nb * 32, generator=g), fmt)
    qs, dm = pack(raw, fmt)
    assert qs.shape == (2, nb * 256) and dm.shape == (2, nb * 32)
    w = torch.empty(32, nb * 32)
    for p in range(2):
        for b in range(nb):
            d = dm[p, b * 32:b * 32 + 16]
            m = dm[p, b * 32 + 16:b * 32 + 32]
            for c in range(8):
                chunk = qs[p, b * 256 + c * 32:b * 256 + c * 32 + 32]
                for j in range(32):
                    row, e = p * 16 + j // 2, j % 2
                    for h, q in enumerate((chunk[j] & 0x0F, chunk[j] >> 4)):
                        w[row, b * 32 + 4 * c + 2 * h + e] = q.float() * d[j // 2] + m[j // 2]
    assert torch.equal(w[:n], dequantize(raw, fmt))
    assert torch.equal(w[n:], torch.zeros(32 - n, nb * 32))
