"""The op-by-op path's SwiGLU and rotate-half RoPE on the native CPU kernels against their torch
references (kernels/layer_ops.py), on odd sizes and strided inputs.

Bounds: RoPE is the same products and sums as the reference, but the compiler fuses a product
and the sum into one FMA, which skips that product's rounding: each result is within half a unit
in the last place of each product and of the sum of the exact value, so the two differ by less
than 4 · 2^-24 · (|x1·cos| + |x2·sin|). SwiGLU's e^-g is a polynomial (the fused
decode block's, avx2_math.h) within a few units in the last place, and each of its division and
product rounds once: |error| ≤ 8 · 2^-24 · |silu(g) · up|."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pdserve_kernels as ops
from pdserve_kernels import cpu_lib, layer_ops

pytestmark = pytest.mark.skipif(not cpu_lib.availability(), reason="the native CPU kernels do not run here")

ULP = 2.0 ** -24


@pytest.mark.parametrize("rows,inter", [(1, 1), (3, 8), (7, 13), (33, 1536), (2, 4099)])
def test_silu_and_mul_equals_the_reference(rows, inter):
    g = torch.Generator().manual_seed(rows * 7 + inter)
    wide = torch.randn(rows, 2 * inter + 5, generator=g) * 4  # gates well into both tails
    x = wide[:, :2 * inter]                                   # rows strided: a view, as a slice is
    ref = layer_ops.silu_and_mul(x)
    got = layer_ops.silu_and_mul_cpu(x)
    assert got.shape == ref.shape == (rows, inter)
    bound = 8 * ULP * (F.silu(x[:, :inter]) * x[:, inter:]).abs() + 1e-30
    assert ((got - ref).abs() <= bound).all(), (got - ref).abs().max()


def test_silu_and_mul_keeps_leading_dims_and_other_dtypes_take_the_reference():
    x = torch.randn(2, 3, 10)
    assert layer_ops.silu_and_mul_cpu(x).shape == (2, 3, 5)
    half = torch.randn(4, 10).to(torch.bfloat16)
    assert torch.equal(layer_ops.silu_and_mul_cpu(half), layer_ops.silu_and_mul(half))


@pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 2), (5, 3, 18), (64, 12, 64), (9, 4, 80)])
def test_rotate_halves_equals_the_reference(tokens, heads, dim):
    g = torch.Generator().manual_seed(tokens * 100 + heads * 10 + dim)
    fused = torch.randn(tokens, heads + 2, dim, generator=g)  # q/k heads beside v heads, as qkv
    x = fused[:, :heads]
    angle = torch.rand(tokens, 1, dim // 2, generator=g) * 100
    cos, sin = angle.cos(), angle.sin()
    ref = layer_ops.rotate_halves(x, cos, sin)
    got = layer_ops.rotate_halves_cpu(x, cos, sin)
    assert got.shape == ref.shape and got.is_contiguous()
    x1, x2 = x.chunk(2, dim=-1)
    size = torch.cat(((x1 * cos).abs() + (x2 * sin).abs(), (x2 * cos).abs() + (x1 * sin).abs()), dim=-1)
    assert ((got - ref).abs() <= 4 * ULP * size).all(), (got - ref).abs().max()
    assert torch.equal(fused[:, :heads], x)  # the input is not touched


def test_the_op_api_binds_both_to_the_native_variants(restore_ops):
    ops.configure("cpu", torch.float32, "native")
    assert ops.is_native(ops.silu_and_mul) and ops.is_native(ops.rotate_halves)
    ops.configure("cpu", torch.float32, "torch")
    assert not ops.is_native(ops.silu_and_mul) and not ops.is_native(ops.rotate_halves)
