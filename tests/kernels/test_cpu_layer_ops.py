"""The op-by-op path's rotate-half RoPE on the native CPU kernels against its torch reference
(kernels/layer_ops.py), on odd sizes and strided inputs: bit for bit, since the native function
computes the same products and sums in the same order and its unit is built without FMA
contraction (which would skip a product's rounding)."""
from __future__ import annotations

import pytest
import torch

import pdserve_kernels as ops
from pdserve_kernels import cpu_lib, layer_ops

pytestmark = pytest.mark.skipif(not cpu_lib.availability(), reason="the native CPU kernels do not run here")


@pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 2), (5, 3, 18), (64, 12, 64), (9, 4, 80)])
def test_rotate_halves_equals_the_reference_bit_for_bit(tokens, heads, dim):
    g = torch.Generator().manual_seed(tokens * 100 + heads * 10 + dim)
    fused = torch.randn(tokens, heads + 2, dim, generator=g)  # q/k heads beside v heads, as qkv
    x = fused[:, :heads]
    angle = torch.rand(tokens, 1, dim // 2, generator=g) * 100
    cos, sin = angle.cos(), angle.sin()
    got = layer_ops.rotate_halves_cpu(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, layer_ops.rotate_halves(x, cos, sin))
    assert torch.equal(fused[:, :heads], x)  # the input is not touched


def test_other_dtypes_take_the_reference():
    x, cos = torch.randn(3, 2, 8).to(torch.bfloat16), torch.rand(3, 1, 4)
    assert torch.equal(layer_ops.rotate_halves_cpu(x, cos, cos), layer_ops.rotate_halves(x, cos, cos))


def test_the_op_api_binds_the_native_variant(restore_ops):
    ops.configure("cpu", torch.float32, "native")
    assert ops.is_native(ops.rotate_halves)
    ops.configure("cpu", torch.float32, "torch")
    assert not ops.is_native(ops.rotate_halves)
