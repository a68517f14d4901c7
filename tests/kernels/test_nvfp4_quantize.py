"""Block scales, tensor scales and quantization with ModelOpt's formulas (docs/nvfp4.md)."""
from __future__ import annotations

import pytest
import torch

from pdserve_kernels.nvfp4 import (
    dequantize,
    e2m1_decode,
    input_scale_from_amax,
    quantize_activation,
    quantize_weight,
    unpack_nibbles,
)

MIN_SCALE = 2.0**-9


def _blocks(t: torch.Tensor) -> torch.Tensor:
    return t.float().unflatten(-1, (-1, 16))


def test_quantize_weight_has_modelopt_shapes_and_dtypes() -> None:
    w = torch.randn(48, 256, dtype=torch.bfloat16)
    q = quantize_weight(w)
    assert q.weight.dtype == torch.uint8 and q.weight.shape == (48, 128)
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (48, 16)
    assert q.weight_scale_2.dtype == torch.float32 and q.weight_scale_2.shape == ()
    packed, scale, scale_2 = q  # unpacks like the (packed, weight_scale, weight_scale_2) tuple
    assert packed is q.weight


def test_weight_scales_follow_the_formulas() -> None:
    w = torch.randn(32, 128) * 0.05
    q = quantize_weight(w)
    assert q.weight_scale_2.item() == pytest.approx(w.abs().max().item() / (6 * 448), rel=1e-6)
    expected = (_blocks(w).abs().amax(-1) / (6 * q.weight_scale_2)).clamp(MIN_SCALE, 448)
    assert torch.equal(q.weight_scale, expected.to(torch.float8_e4m3fn))
    # The largest block uses the top of the E4M3 range.
    assert q.weight_scale.float().max().item() == 448.0


def test_weight_round_trip_error_is_within_one_scale_step() -> None:
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(2))
    q = quantize_weight(w)
    step = q.weight_scale.float().repeat_interleave(16, dim=1) * q.weight_scale_2
    err = (dequantize(q.weight, q.weight_scale, q.weight_scale_2) - w).abs()
    assert (err <= step * 1.0001).all()  # half the widest E2M1 gap (4 -> 6) is one step
    assert err.pow(2).mean().sqrt() / w.pow(2).mean().sqrt() < 0.12


def test_zero_and_tiny_blocks_get_the_minimum_scale_and_zero_codes() -> None:
    w = torch.randn(4, 64)
    w[1, 16:32] = 0.0
    w[2, 32:48] = 1e-30
    q = quantize_weight(w)
    assert q.weight_scale[1, 1].float().item() == MIN_SCALE
    assert q.weight_scale[2, 2].float().item() == MIN_SCALE
    codes = unpack_nibbles(q.weight)
    assert (e2m1_decode(codes[1, 16:32]) == 0).all()
    assert (e2m1_decode(codes[2, 32:48]) == 0).all()
    assert torch.isfinite(dequantize(q.weight, q.weight_scale, q.weight_scale_2)).all()


def test_all_zero_weight_quantizes_to_zero() -> None:
    q = quantize_weight(torch.zeros(8, 32))
    assert q.weight_scale_2.item() > 0
    assert (dequantize(q.weight, q.weight_scale, q.weight_scale_2) == 0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_rejected(bad: float) -> None:
    w = torch.randn(4, 32)
    w[0, 3] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_weight(w)


def test_weight_shape_must_be_a_multiple_of_16() -> None:
    with pytest.raises(ValueError):
        quantize_weight(torch.randn(4, 24))


def test_activation_quantization_follows_the_formulas() -> None:
    x = torch.randn(8, 128, dtype=torch.bfloat16)
    input_scale = input_scale_from_amax(x.float().abs().max())
    gs = 1.0 / input_scale
    qa = quantize_activation(x, input_scale)
    sf = (_blocks(x).abs().amax(-1) * gs / 6).clamp(max=448).to(torch.float8_e4m3fn)
    assert torch.equal(qa.scale, sf)
    mult = gs / sf.float().repeat_interleave(16, dim=1)
    expected = e2m1_decode(unpack_nibbles(qa.data))
    assert (expected - (x.float() * mult)).abs().max() <= 1.0  # nearest grid point


def test_activation_scale_saturates_when_amax_exceeds_calibration() -> None:
    x = torch.full((1, 32), 2.0)
    x[0, 0] = 1000.0
    qa = quantize_activation(x, input_scale_from_amax(10.0))
    assert qa.scale.float()[0, 0].item() == 448.0
    assert e2m1_decode(unpack_nibbles(qa.data))[0, 0].item() == 6.0


def test_activation_zero_block_has_zero_scale_and_codes() -> None:
    x = torch.zeros(2, 32)
    x[1, 16:] = 1.0
    qa = quantize_activation(x, input_scale_from_amax(1.0))
    assert qa.scale.float()[0].tolist() == [0.0, 0.0]
    assert (dequantize(qa.data, qa.scale)[0] == 0).all()


def test_activation_infinity_saturates_and_nan_is_rejected() -> None:
    x = torch.ones(1, 16)
    x[0, 3] = float("inf")
    x[0, 4] = float("-inf")
    qa = quantize_activation(x, input_scale_from_amax(1.0))
    assert qa.scale.float().item() == 448.0
    values = e2m1_decode(unpack_nibbles(qa.data))[0]
    assert values[3].item() == 6.0 and values[4].item() == -6.0
    x[0, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_activation(x, input_scale_from_amax(1.0))
