"""FP4 E2M1 elements: encode (round-to-nearest-even, saturating), decode, nibble packing.

Codes are 4 bits, sign in bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. Two codes share a
byte with the even element in the low nibble, which is CUTLASS's `float_e2m1_t` storage
order, so packed bytes go to the kernel unchanged.
"""
from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Rounding thresholds between neighbouring magnitudes. A value exactly on a threshold goes to
# the even code: `<=` where the lower neighbour is even, `<` where the upper one is.
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_LOWER_IS_EVEN = (True, False, True, False, True, False, True)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 code (ties to even), saturating at ±6; uint8 codes 0..15.

    ±inf saturates to ±6; NaN has no E2M1 encoding and is rejected with ValueError. The sign
    of zero is kept (-0.0 and negatives that round to zero give code 8).
    """
    if torch.isnan(x).any():
        raise ValueError("NaN has no E2M1 encoding")
    mag = x.abs().to(torch.float32)
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, lower_even in zip(_BOUNDS, _LOWER_IS_EVEN):
        above = mag > bound if lower_even else mag >= bound
        code += above.to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 values (code 8 is -0.0)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    mag = table[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def pack_nibbles(code: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes, element 2j in the low nibble, 2j+1 in the high."""
    if code.shape[-1] % 2:
        raise ValueError("the last dimension must be even to pack two codes per byte")
    code = code.to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes (inverse of pack_nibbles)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
