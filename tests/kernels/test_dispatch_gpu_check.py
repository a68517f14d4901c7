"""bench/gpu_check.py --engine, its CPU-side logic: how two backends' engine runs are compared."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_engine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_equal_tokens_pass_and_report_the_speed_ratio(gpu_check):
    ref = gpu_check.EngineRun("torch", "torch on cuda", [[1, 2, 3] * 4, [4, 5, 6] * 4], 2.0, 24)
    nat = gpu_check.EngineRun("native", "native on cuda", [[1, 2, 3] * 4, [4, 5, 6] * 4], 1.0, 24)
    check = gpu_check.compare_engine_runs(ref, nat)
    assert check.ok and check.err == 0.0
    assert "100% tokens equal; 24.0 tok/s vs torch 12.0 (2.00x)" in check.note


def test_a_late_divergence_passes_an_early_one_fails(gpu_check):
    ref = gpu_check.EngineRun("torch", "", [list(range(16))], 1.0, 16)
    late = gpu_check.EngineRun("native", "", [list(range(12)) + [0, 0, 0, 0]], 1.0, 16)
    early = gpu_check.EngineRun("native", "", [[0, 1, 2, 9] + list(range(4, 16))], 1.0, 16)
    assert gpu_check.compare_engine_runs(ref, late).ok
    assert gpu_check.compare_engine_runs(ref, late).err == pytest.approx(0.25)
    assert not gpu_check.compare_engine_runs(ref, early).ok
