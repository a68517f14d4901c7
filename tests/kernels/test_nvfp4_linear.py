"""NVFP4 linear references: W4A4 as the block-scaled MMA computes it, and W4A16."""
from __future__ import annotations

import torch

from pdserve_kernels.nvfp4 import (
    dequantize,
    input_scale_from_amax,
    nvfp4_linear_w4a4,
    nvfp4_linear_w4a16,
    nvfp4_matmul,
    quantize_activation,
    quantize_weight,
)


def _operands(m: int = 33, n: int = 48, k: int = 256, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) * 0.02
    return x, w, quantize_weight(w), input_scale_from_amax(x.float().abs().max())


def test_dequantized_operands_are_exact_in_float32() -> None:
    _, _, q, _ = _operands()
    as32 = dequantize(q.weight, q.weight_scale)
    as64 = as32.double()
    assert torch.equal(as64.float(), as32)
    # code * E4M3 has at most 6 significant bits: it survives a round trip through bf16.
    assert torch.equal(as32.to(torch.bfloat16).float(), as32)


def test_w4a4_emulation_matches_float64_on_the_same_quantized_operands() -> None:
    x, _, q, input_scale = _operands()
    xa = quantize_activation(x, input_scale)
    alpha = input_scale * q.weight_scale_2
    got = nvfp4_matmul(xa.data, xa.scale, q.weight, q.weight_scale, alpha, out_dtype=torch.float32)
    a64 = dequantize(xa.data, xa.scale).double()
    b64 = dequantize(q.weight, q.weight_scale).double()
    ref = (a64 @ b64.T) * alpha.double()
    assert ((got.double() - ref).abs() <= 1e-5 * ref.abs().max()).all()


def test_w4a4_linear_is_close_to_the_unquantized_product() -> None:
    x, w, q, input_scale = _operands()
    y = nvfp4_linear_w4a4(x, q.weight, q.weight_scale, q.weight_scale_2, input_scale)
    assert y.dtype == torch.bfloat16 and y.shape == (33, 48)
    ref = x.float() @ w.T
    rel = (y.float() - ref).norm() / ref.norm()
    assert rel < 0.2, rel


def test_w4a4_linear_keeps_leading_dimensions() -> None:
    x, _, q, input_scale = _operands()
    y = nvfp4_linear_w4a4(x.reshape(3, 11, 256), q.weight, q.weight_scale, q.weight_scale_2,
                          input_scale)
    assert y.shape == (3, 11, 48)


def test_w4a16_equals_the_dequantized_weight_product() -> None:
    x, w, q, _ = _operands()
    y = nvfp4_linear_w4a16(x, q.weight, q.weight_scale, q.weight_scale_2)
    w64 = dequantize(q.weight, q.weight_scale).double() * q.weight_scale_2.double()
    ref = x.double() @ w64.T
    assert y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-6).all()  # one bf16 rounding
    assert (y.float() - x.float() @ w.T).norm() / (x.float() @ w.T).norm() < 0.15
