"""Block-quantized weights (GGUF Q4_0, Q4_1, Q8_0): formats, torch references, native matmul,
and the Q4 packing of the int16-activation path (packed.py).

Each op has a `torch` implementation (the reference, any device) and a `native` one (the
AVX2 / AVX-512 VNNI kernels of csrc/cpu/, CPU only); `qmatmul` picks native when the library is
available and the input is on the CPU. The op API (`pdserve_kernels.qmatmul`) binds one of the
two per process and logs the choice.
"""
from __future__ import annotations

import torch

from .. import cpu_lib
from .formats import BLOCK, FORMATS, Q4_0, Q4_1, Q8_0, BlockFormat, block_format
from .packed import Packed, pack, pack_q4, packable
from .reference import (dequantize, qmatmul_emulated, qmatmul_torch, quantize,
                        quantize_activations, round_activations_int16)

__all__ = ["BLOCK", "FORMATS", "Q4_0", "Q4_1", "Q8_0", "BlockFormat", "Packed",
           "block_format", "dequantize", "native_available", "pack", "pack_q4", "packable", "qmatmul",
           "qmatmul_emulated", "qmatmul_native", "qmatmul_packed_cpu", "qmatmul_packed_reference",
           "qmatmul_torch", "quantize", "quantize_activations", "round_activations_int16"]


def native_available() -> bool:
    """Whether the native CPU kernels are built and run on this CPU (builds them on first use)."""
    return bool(cpu_lib.availability())


GEMM_SLICE = 4096  # weight rows the gemm path dequantizes at a time


def qmatmul_native(x: torch.Tensor, raw: torch.Tensor, fmt: BlockFormat, isa: str | None = None,
                   threads: int | None = None, path: str = "auto") -> torch.Tensor:
    """x [M, K] @ W^T on the CPU kernels, fp32 out. `path`: f32 (weights dequantized in
    registers, or in panels of 16 rows from 64 rows on AVX-512; fp32 activations), gemm
    (weights dequantized in slices, torch's GEMM), int8 (activations quantized per block of 32,
    integer dot products, as llama.cpp does) or auto (f32 at every row count: the whole product
    stays on the kernels' thread pool, so torch can keep one thread; docs/cpu-threads.md).
    `isa` forces avx2 | avx512 (tests)."""
    n, k = raw.shape[0], x.shape[-1]
    x = x.to(torch.float32)
    if path == "gemm":
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        for start in range(0, n, GEMM_SLICE):
            stop = min(n, start + GEMM_SLICE)
            w = cpu_lib.dequantize(fmt.code, raw[start:stop], stop - start, k, isa, threads)
            torch.matmul(x, w.T, out=y[:, start:stop])
        return y
    return cpu_lib.qmatmul(fmt.code, x, raw, n, k, isa, threads, "f32" if path == "auto" else path)


def qmatmul_packed_reference(x: torch.Tensor, raw: torch.Tensor, fmt: BlockFormat, packed: Packed
                             ) -> torch.Tensor:
    """`qmatmul_packed`'s reference: activations rounded to int16 per block of 32, then the
    blocks' reference (`packed`, which changes nothing but speed, unused)."""
    return qmatmul(round_activations_int16(x), raw, fmt, force="torch")


def qmatmul_packed_cpu(x: torch.Tensor, raw: torch.Tensor, fmt: BlockFormat, packed: Packed
                       ) -> torch.Tensor:
    """y = round16(x) W^T, any leading dims, in x's dtype (AVX-512 VNNI): the packed int16 kernel
    for every row count (`raw` unused: the packed copy holds the same weights)."""
    lead, k = x.shape[:-1], x.shape[-1]
    y = cpu_lib.qmatmul_packed(fmt.code, x.reshape(-1, k).to(torch.float32), packed.qs, packed.dm, raw.shape[0], k)
    return y.reshape(*lead, raw.shape[0]).to(x.dtype)


def qmatmul(x: torch.Tensor, raw: torch.Tensor, fmt: BlockFormat, force: str | None = None
            ) -> torch.Tensor:
    """y = x W^T for W stored as rows of `fmt` blocks, any leading dims, in x's dtype.

    `force`: "torch" or "native"; default native when available and x is on the CPU.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    if raw.shape[-1] != fmt.row_bytes(k):
        raise ValueError(f"{fmt.name} weight has {fmt.columns(raw.shape[-1])} input features, "
                         f"the input {k}")
    native = force == "native" or (force is None and x.device.type == "cpu" and native_available())
    if native and (x.device.type != "cpu" or raw.device.type != "cpu"):
        raise ValueError(f"the native block-quantized matmul runs on the CPU; the input is on {x.device}")
    x2 = x.reshape(-1, k)
    y = qmatmul_native(x2, raw, fmt) if native else qmatmul_torch(x2, raw, fmt)
    return y.reshape(*lead, raw.shape[0]).to(x.dtype)
