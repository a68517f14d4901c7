"""The native CPU kernels for GGUF blocks (csrc/cpu) against their torch references.

Each path is forced on each instruction set this CPU has (AVX2 everywhere; AVX-512 VNNI where
present), on odd shapes: M = 1, 3, 17, 64; N and K not multiples of any tile (K a multiple of the
block of 32).

Bounds, and why:
* int8 path vs `qmatmul_emulated` (the same activation rounding, summed exactly in float64):
  the kernel's integer block sums are exact; what differs is fp32 rounding of the per-block scale
  products and of the running sum over K/32 blocks: at most about (K/32 + 3) * 2^-24 of
  sum |terms|. We allow 1e-5 * sum |terms| (K <= 640 here: 23 blocks, ~1.6e-6 needed).
* int8 path vs `qmatmul_torch` (dequantize, then matmul fp32 activations): plus the activation
  rounding, |x - q * d| <= d / 2 = amax(block) / 254 per element, so
  |dy| <= sum_k |W[n, k]| * amax(block of k) / 254 — computed per output, times 1.0001.
* f32 path (dequantized in registers for few rows, in panels for many) and gemm path (torch's
  GEMM on dequantized slices) vs the reference in float64: fp32 products and sums only (the
  dequantized weight may differ by one rounding where d*q + m is one FMA), 1e-5 * sum |terms|.
"""
from __future__ import annotations

import pytest
import torch

from pdserve_kernels import cpu_lib
from pdserve_kernels.quant import (BLOCK, FORMATS, dequantize, qmatmul_emulated, qmatmul_native,
                                   qmatmul_torch, quantize)

ISAS = [isa for isa in ("avx2", "avx512") if cpu_lib.isa_supported(isa)]
SHAPES = [(1, 37, 96), (3, 53, 160), (17, 29, 64), (64, 19, 640)]  # (M, N, K)
# the gemm path dequantizes 4096 weight rows at a time: one shape spans two slices
GEMM_SHAPES = SHAPES + [(64, 4100, 64)]


def test_make_setup_built_the_native_cpu_kernels():
    """`make setup` compiles csrc/cpu/; every test below needs the library."""
    avail = cpu_lib.availability()
    assert avail, avail.reason


def _case(fmt_name: str, m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.2
    x = torch.randn(m, k, generator=g) * 3.0
    x[:, :BLOCK] = 0.0  # an all-zero activation block (scale 0) is an edge case of its own
    return x, quantize(w, FORMATS[fmt_name])


def _abs_terms(x: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    return x.abs().double() @ wd.abs().double().T


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_path_equals_its_emulation_and_the_reference(isa, fmt_name, m, n, k):
    fmt = FORMATS[fmt_name]
    x, raw = _case(fmt_name, m, n, k, seed=m * 1000 + n)
    y = qmatmul_native(x, raw, fmt, isa=isa, path="int8", threads=2).double()
    wd = dequantize(raw, fmt)
    exact = qmatmul_emulated(x, raw, fmt)
    assert (y - exact).abs().le(1e-5 * _abs_terms(x, wd) + 1e-12).all()
    amax = x.abs().reshape(m, -1, BLOCK).amax(-1).repeat_interleave(BLOCK, dim=-1)
    bound = (amax.double() / 254) @ wd.abs().double().T * 1.0001 + 1e-5 * _abs_terms(x, wd)
    ref = x.double() @ wd.double().T
    assert (y - ref).abs().le(bound).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("path", ["f32", "gemm"])
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
def test_float_paths_equal_the_reference(isa, path, fmt_name, m, n, k):
    fmt = FORMATS[fmt_name]
    x, raw = _case(fmt_name, m, n, k, seed=m * 1000 + n + 1)
    y = qmatmul_native(x, raw, fmt, isa=isa, path=path, threads=2).double()
    ref = x.double() @ dequantize(raw, fmt).double().T
    assert (y - ref).abs().le(1e-5 * _abs_terms(x, dequantize(raw, fmt)) + 1e-12).all()


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_default_path_keeps_fp32_activations_at_every_size(fmt_name):
    """Decode-sized and prefill-sized inputs (panels from 64 rows on AVX-512) through the default
    choice: all within fp32 rounding of the reference, never the int8 rounding."""
    fmt = FORMATS[fmt_name]
    for m in (1, 20, 70):
        x, raw = _case(fmt_name, m, 45, 192, seed=m)
        y = qmatmul_native(x, raw, fmt).double()
        wd = dequantize(raw, fmt)
        assert (y - qmatmul_torch(x, raw, fmt).double()).abs().le(1e-5 * _abs_terms(x, wd) + 1e-12).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_native_dequantize_equals_the_torch_reference(isa, fmt_name):
    fmt = FORMATS[fmt_name]
    _, raw = _case(fmt_name, 1, 21, 96, seed=7)
    out = cpu_lib.dequantize(fmt.code, raw, 21, 96, isa=isa)
    assert torch.equal(out, dequantize(raw, fmt))


def test_an_isa_this_cpu_lacks_is_a_clear_error():
    if cpu_lib.isa_supported("avx512"):
        pytest.skip("this CPU has AVX-512 VNNI, so there is no instruction set it lacks to ask for; "
                    "the error is checked on AVX2-only CPUs")
    x, raw = _case("Q8_0", 1, 4, 32, seed=0)
    with pytest.raises(RuntimeError, match="instruction set unavailable"):
        qmatmul_native(x, raw, FORMATS["Q8_0"], isa="avx512")


def test_the_library_has_no_amx_instruction():
    """The build never emits AMX (no -march=native): a tile instruction faults in a process that has
    not asked Linux for the tile state, which the library never does (docs/quantization.md, "AMX")."""
    import subprocess

    path = cpu_lib.build()
    listing = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True).stdout
    assert listing and not any(op in listing for op in ("ldtilecfg", "tdpb", "tileloadd", "tilezero"))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_f32_dot_path_gives_a_row_the_same_bits_alone_and_among_others(isa, fmt_name):
    """Decode batch invariance at the kernel: the dot path's tiles (several activation rows times
    several weight rows) sum every output in the same order, so a row's result does not depend on
    how many rows share the call (1 to 15: the rows below the AVX-512 panels)."""
    fmt = FORMATS[fmt_name]
    x, raw = _case(fmt_name, 15, 43, 160, seed=11)
    alone = torch.cat([qmatmul_native(x[i:i + 1], raw, fmt, isa=isa, path="f32", threads=1) for i in range(15)])
    for m in (2, 3, 4, 5, 8, 9, 15):
        together = qmatmul_native(x[:m], raw, fmt, isa=isa, path="f32", threads=2)
        assert torch.equal(together, alone[:m]), m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_f32_dot_path_reads_subnormal_and_large_fp16_scales_exactly(isa, fmt_name):
    """The dot paths convert block scales through a table of every fp16 value: tiny weights
    (subnormal fp16 scales) and large ones must match the reference as closely as any others."""
    fmt = FORMATS[fmt_name]
    for scale in (1e-4, 1e4):  # scales below fp16's smallest normal (6.1e-5), and in the tens
        x, raw = _case(fmt_name, 3, 21, 96, seed=5)
        raw = quantize(dequantize(raw, fmt) * scale, fmt)
        y = qmatmul_native(x, raw, fmt, isa=isa, path="f32").double()
        wd = dequantize(raw, fmt)
        assert wd.abs().max() > 0
        assert (y - x.double() @ wd.double().T).abs().le(1e-5 * _abs_terms(x, wd) + 1e-30).all(), scale
