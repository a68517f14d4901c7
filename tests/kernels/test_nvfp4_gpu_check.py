"""bench/gpu_check.py imports and runs its CPU parts here (no GPU): the no-GPU path and the
emulated path, where the references stand in for the kernels and every check must pass."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_reports_why_and_passes(gpu_check, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_KERNELS_LIB", str(tmp_path / "missing.so"))
    out = tmp_path / "report.json"
    assert gpu_check.main(["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["available"] is False and report["reason"]
    assert all(c["ok"] for c in report["checks"])


def test_emulated_checks_all_pass(gpu_check, tmp_path) -> None:
    out = tmp_path / "report.json"
    assert gpu_check.main(["--emulate", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    names = {c["name"] for c in report["checks"]}
    assert names == {"nvfp4_quantize", "nvfp4_gemv", "attn_prefill", "attn_decode", "nvfp4_gemm_sm120"}
    assert all(c["ok"] for c in report["checks"])
