"""E2M1 encode/decode and nibble packing (docs/nvfp4.md, "Numbers")."""
from __future__ import annotations

import pytest
import torch

from pdserve_kernels.nvfp4 import E2M1_VALUES, e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles


def _nearest_even_reference(x: torch.Tensor) -> torch.Tensor:
    """Brute force in float64: nearest magnitude, ties to the even code, saturating at 6."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    mag = x.to(torch.float64).abs().clamp(max=6.0)
    dist = (mag[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best
    even = torch.arange(8) % 2 == 0
    # Among tied codes, prefer the even one (there is always exactly one on a tie).
    code = torch.where(candidates & even, 1, 0).argmax(dim=1)
    single = candidates.sum(dim=1) == 1
    code = torch.where(single, candidates.to(torch.int64).argmax(dim=1), code)
    return (code | (torch.signbit(x).to(torch.int64) << 3)).to(torch.uint8)


def test_every_e2m1_code_round_trips() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert values[:8].tolist() == list(E2M1_VALUES)
    assert values[8:].tolist() == [-v for v in E2M1_VALUES]
    assert torch.signbit(values[8])  # code 8 is -0.0
    assert torch.equal(e2m1_encode(values), codes)


def test_ties_round_to_even_code() -> None:
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(e2m1_decode(e2m1_encode(ties)), expected)
    assert torch.equal(e2m1_decode(e2m1_encode(-ties)), -expected)


def test_random_values_round_to_nearest_even() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * 3
    x[:1000] = torch.tensor(E2M1_VALUES).repeat(125) + torch.tensor([0.25, -0.25]).repeat(500)
    assert torch.equal(e2m1_encode(x), _nearest_even_reference(x))


def test_out_of_range_and_infinity_saturate_to_six() -> None:
    x = torch.tensor([6.0, 6.5, 100.0, float("inf"), -7.0, float("-inf")])
    assert e2m1_decode(e2m1_encode(x)).tolist() == [6.0, 6.0, 6.0, 6.0, -6.0, -6.0]


def test_nan_is_rejected() -> None:
    with pytest.raises(ValueError, match="NaN"):
        e2m1_encode(torch.tensor([1.0, float("nan")]))


def test_negative_values_rounding_to_zero_keep_the_sign() -> None:
    assert e2m1_encode(torch.tensor([-0.1, -0.0, 0.1])).tolist() == [8, 8, 0]


def test_even_element_goes_to_the_low_nibble() -> None:
    assert pack_nibbles(torch.tensor([0x1, 0x2, 0xF, 0x8], dtype=torch.uint8)).tolist() == [0x21, 0x8F]


def test_pack_unpack_round_trip() -> None:
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = pack_nibbles(codes)
    assert packed.shape == (7, 32)
    assert torch.equal(unpack_nibbles(packed), codes)


def test_pack_rejects_odd_length() -> None:
    with pytest.raises(ValueError):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))
