"""Host-only entries of the built library agree with the torch reference; launches without a
GPU return an error status instead of crashing. Needs nvcc (the library is built, cached)."""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve_kernels import cuda_lib
from pdserve_kernels.nvfp4 import swizzle_offset, swizzled_size

from .test_csrc_build import ROOT, _nvcc

pytestmark = [
    pytest.mark.skipif(_nvcc() is None, reason="nvcc not found: the CUDA library cannot be built"),
    pytest.mark.timeout(1800),
]


@pytest.fixture(scope="module")
def lib_path(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("kernels")
    proc = subprocess.run([sys.executable, str(ROOT / "csrc" / "build.py"), "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "build.json").read_text())["library"]


@pytest.fixture()
def lib(lib_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNELS_LIB", lib_path)  # the wrappers load this one
    return cuda_lib.load(lib_path)


@pytest.mark.parametrize("rows,k_blocks", [(200, 96), (130, 256), (130, 6)])
def test_cute_scale_offsets_equal_the_reference_formula(lib, rows: int, k_blocks: int) -> None:
    k = 16 * k_blocks
    for r in range(rows):
        for kb in range(k_blocks):
            assert lib.pds_nvfp4_sf_offset(rows, k, r, kb) == swizzle_offset(r, kb, k_blocks), (r, kb)
    assert lib.pds_nvfp4_sf_bytes(rows, k) == swizzled_size(rows, k_blocks)
    assert lib.pds_nvfp4_sf_offset(rows, k, rows, 0) == -1  # out of range


def test_gemm_workspace_size(lib) -> None:
    assert cuda_lib.nvfp4_gemm_workspace_bytes(256, 512, 1024) >= 0
    assert cuda_lib.nvfp4_gemm_workspace_bytes(256, 512, 1000) == -1  # K not a multiple of 32


def test_decode_workspace_size(lib) -> None:
    assert cuda_lib.attn_decode_workspace_bytes(3, 8, 128, 1) == 0
    assert cuda_lib.attn_decode_workspace_bytes(3, 8, 128, 4) == 4 * 3 * 8 * (128 + 1) * 4


def _has_gpu(lib) -> bool:
    return cuda_lib.device_capability(lib) is not None


def test_available_says_why_not_without_a_gpu(lib) -> None:
    if _has_gpu(lib):
        pytest.skip("checks the no-GPU path and a GPU is present (bench/gpu_check.py tests the GPU path)")
    avail = cuda_lib.available()
    assert not avail and "no CUDA device" in avail.reason


def test_every_launch_returns_no_device_without_a_gpu(lib) -> None:
    if _has_gpu(lib):
        pytest.skip("checks the no-GPU path and a GPU is present (bench/gpu_check.py tests the GPU path)")
    buf = torch.zeros(1 << 16, dtype=torch.uint8)  # host memory: never touched on this path
    p, s = ctypes.c_void_p(buf.data_ptr()), None
    assert lib.pds_nvfp4_gemm_bf16(p, p, p, p, p, None, 1.0, 128, 128, 128, None, 0, s) == 1
    assert lib.pds_nvfp4_quantize_bf16(p, p, p, None, 1.0, 4, 64, s) == 1
    assert lib.pds_nvfp4_gemv_bf16(p, p, p, p, 0, 1.0, 1, 64, 64, s) == 1
    assert lib.pds_attn_prefill_bf16(p, p, p, p, p, p, 1, 8, 4, 2, 64, 0.125, 1, s) == 1
    assert lib.pds_attn_decode_paged_bf16(p, p, p, p, p, p, 1, 4, 2, 64, 16, 4, 0.125, 1, None,
                                          0, s) == 1


def test_invalid_arguments_are_rejected_before_any_device_call(lib) -> None:
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    p = ctypes.c_void_p(buf.data_ptr())
    assert lib.pds_nvfp4_gemm_bf16(None, p, p, p, p, None, 1.0, 128, 128, 128, None, 0, None) == 3
    assert lib.pds_nvfp4_gemm_bf16(p, p, p, p, p, None, 1.0, 128, 128, 100, None, 0, None) == 3
    assert lib.pds_nvfp4_gemv_bf16(p, p, p, p, 0, 1.0, 17, 64, 64, None) == 3  # m > 16
    assert lib.pds_attn_prefill_bf16(p, p, p, p, p, p, 1, 8, 4, 2, 96, 0.1, 1, None) == 3
    assert lib.pds_attn_decode_paged_bf16(p, p, p, p, p, p, 1, 4, 3, 64, 16, 4, 0.1, 1, None, 0,
                                          None) == 3  # 4 q heads over 3 kv heads
    assert lib.pds_attn_decode_paged_bf16(p, p, p, p, p, p, 1, 4, 2, 64, 16, 4, 0.1, 2, None, 0,
                                          None) == 4  # split-KV without workspace


def test_wrappers_raise_kernel_error_without_a_gpu(lib) -> None:
    if _has_gpu(lib):
        pytest.skip("checks the no-GPU path and a GPU is present (bench/gpu_check.py tests the GPU path)")
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(cuda_lib.KernelError) as err:
        cuda_lib.nvfp4_quantize(x, 1.0)
    assert err.value.status == 1
    w = torch.zeros(64, 32, dtype=torch.uint8)
    with pytest.raises(cuda_lib.KernelError):
        cuda_lib.nvfp4_gemv(x, w, torch.zeros(64, 4, dtype=torch.uint8), 1.0)


def test_library_path_prefers_the_environment(lib_path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_KERNELS_LIB", lib_path)
    assert cuda_lib.library_path() == Path(lib_path)
    monkeypatch.setenv("PDSERVE_KERNELS_LIB", "/nonexistent/lib.so")
    assert cuda_lib.library_path() is None
    assert not cuda_lib.available()
