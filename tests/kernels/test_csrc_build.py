"""csrc/ builds with nvcc into one library that loads through ctypes on a machine without a GPU.

Needs nvcc (skipped without it, with the reason). The first build compiles the CUTLASS GEMM
(minutes); later runs on the same machine reuse ~/.cache/pdserve/kernels. SASS checks need
cuobjdump + nvdisasm (PyPI: nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve_kernels import cuda_lib

ROOT = Path(__file__).resolve().parents[2]
FP4_MMA = "OMMA.SF.16864.F32.E2M1.E2M1.UE4M3"
PORTABLE_UNITS = ("nvfp4_quant.cu", "nvfp4_gemv.cu", "attn_prefill.cu", "attn_decode.cu")


def _nvcc() -> str | None:
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    return shutil.which("nvcc") or (str(home) if home.exists() else None)


def _cuda_tools_dir() -> str | None:
    """Directory with cuobjdump and nvdisasm: PATH, or the nvidia-cuda-* wheels in this venv."""
    if shutil.which("cuobjdump") and shutil.which("nvdisasm"):
        return str(Path(shutil.which("cuobjdump")).parent)
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for bin_dir in Path(base).glob("cu*/bin"):
            if (bin_dir / "cuobjdump").exists() and (bin_dir / "nvdisasm").exists():
                return str(bin_dir)
    return None


pytestmark = [
    pytest.mark.skipif(_nvcc() is None, reason="nvcc not found: the CUDA library cannot be built"),
    pytest.mark.timeout(1800),  # an uncached build compiles the CUTLASS GEMM twice (2 jobs)
]


@pytest.fixture(scope="module")
def build_info(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("kernels")
    proc = subprocess.run([sys.executable, str(ROOT / "csrc" / "build.py"), "--jobs", "2",
                           "--probes", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads((out / "build.json").read_text())
    info["out_lib"] = str(out / cuda_lib.LIB_NAME)
    return info


@pytest.fixture(scope="module")
def lib(build_info):
    return cuda_lib.load(build_info["out_lib"])


def _sass(obj: str) -> str:
    tools = _cuda_tools_dir()
    if tools is None:
        pytest.fail("cuobjdump/nvdisasm not found: `make test` installs them "
                    "(pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    env = dict(os.environ, PATH=f"{tools}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(["cuobjdump", "--dump-sass", obj], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _elf_archs(obj: str) -> set[str]:
    tools = _cuda_tools_dir()
    if tools is None:
        pytest.fail("cuobjdump not found: `make test` installs it (pip install nvidia-cuda-cuobjdump)")
    proc = subprocess.run([str(Path(tools) / "cuobjdump"), "--list-elf", obj], capture_output=True,
                          text=True)
    return {line.rsplit(".", 2)[-2] for line in proc.stdout.splitlines() if line.endswith(".cubin")}


def test_gemm_object_contains_block_scaled_fp4_mma(build_info) -> None:
    gemm = build_info["objects"]["nvfp4_gemm_sm120_128x128x128.cu"]
    assert gemm["archs"] == ["sm_120a"]
    assert _sass(gemm["object"]).count(FP4_MMA) > 0


def test_plain_sm120_gemm_build_has_no_fp4_mma_the_trap(build_info) -> None:
    plain = build_info["probes"]["gemm_plain_sm120"]
    sass = _sass(plain["object"])
    assert "sm_120" in _elf_archs(plain["object"])
    assert "OMMA" not in sass  # compiled "successfully", MMA body left out


def test_portable_kernels_carry_sm80_sm90a_and_sm120a_code(build_info) -> None:
    for unit in PORTABLE_UNITS:
        assert _elf_archs(build_info["objects"][unit]["object"]) == {"sm_80", "sm_90a", "sm_120a"}, unit


def test_second_build_is_a_cache_hit(build_info, tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "csrc" / "build.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = json.loads((tmp_path / "build.json").read_text())
    assert info["key"] == build_info["key"]
    assert all(o["cached"] for o in info["objects"].values())


def test_library_exports_only_the_c_abi(build_info) -> None:
    if shutil.which("nm") is None:
        pytest.skip("binutils' nm is not on this machine (nvcc's host toolchain normally brings it)")
    proc = subprocess.run(["nm", "-D", "--defined-only", build_info["out_lib"]], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    names = {line.split()[-1] for line in proc.stdout.splitlines() if line.strip()}
    assert set(cuda_lib._SIGNATURES) <= names
    assert not any(n.startswith("cuda") for n in names)  # static cudart stays hidden


def test_library_loads_through_ctypes(lib) -> None:
    assert lib.pds_abi_version() == cuda_lib.ABI_VERSION
    assert lib.pds_status_name(1) == b"no CUDA device"
