"""The 2-minute soak (bench/soak.py): a mixed load against `pdserve serve` PD TP=3, then no
unexpected failure, RSS and file descriptors flat, every worker idle with a full KV pool."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.frontend.conftest import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


def test_a_two_minute_soak_leaks_nothing(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench/soak.py"), "--duration", "120", "--port",
                           str(free_port()), "--out", str(out), "--log", str(tmp_path / "serve.log")],
                          capture_output=True, text=True, timeout=840)
    assert out.exists(), proc.stderr[-3000:] + (tmp_path / "serve.log").read_text()[-5000:]
    summary = json.loads(out.read_text())
    assert summary["failures"] == [] and proc.returncode == 0, summary
    assert summary["ok"] > 0 and summary["dropped_on_purpose"] > 0 and summary["bad_400"] > 0
    assert summary["requests_by_kind"]["mass_abort"] >= 1
