"""NVFP4 (E2M1 elements, E4M3 block scales, FP32 tensor scale): torch reference.

Runs on any device; the CUDA kernels of `csrc/` are tested against it. Facts:
docs/nvfp4.md.
"""
from __future__ import annotations

from .e2m1 import E2M1_MAX, E2M1_VALUES, e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles
from .linear import nvfp4_linear_w4a4, nvfp4_linear_w4a16, nvfp4_matmul
from .quantize import (
    QuantizedActivation,
    QuantizedWeight,
    dequantize,
    quantize_activation,
    quantize_activation_gs,
    quantize_weight,
)
from .scales import BLOCK, E4M3_MAX, input_scale_from_amax, to_e4m3
from .swizzle import swizzle_offset, swizzle_scales, swizzled_size, unswizzle_scales

__all__ = [
    "BLOCK",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "QuantizedActivation",
    "QuantizedWeight",
    "dequantize",
    "e2m1_decode",
    "e2m1_encode",
    "input_scale_from_amax",
    "nvfp4_linear_w4a4",
    "nvfp4_linear_w4a16",
    "nvfp4_matmul",
    "pack_nibbles",
    "quantize_activation",
    "quantize_activation_gs",
    "quantize_weight",
    "swizzle_offset",
    "swizzle_scales",
    "swizzled_size",
    "to_e4m3",
    "unpack_nibbles",
]
