"""Worker lifecycle: /health sees a wedged loop; SIGTERM drains in-flight requests and exits 0."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from pdserve.worker.faults import FaultPlan

from .conftest import PDClient, start_worker, wait_for


async def until(c: PDClient, w, pred, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not pred((await c.http.get(w.url + "/load")).json()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def until_health(c: PDClient, w, status: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (await c.http.get(w.url + "/health")).json().get("status") != status:
        assert time.monotonic() < deadline, f"timed out waiting for /health {status!r}"
        await asyncio.sleep(0.02)


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.timeout(300)
def test_wedged_loop_turns_health_unhealthy(tiny_llama_dir, monkeypatch):
    for name, value in FaultPlan(debug_routes=True).to_env().items():  # POST /debug/wedge exists
        monkeypatch.setenv(name, value)
    w = start_worker("both", tiny_llama_dir, "--health-stall-timeout", "1.5")
    try:
        assert w.get("/health").status_code == 200
        httpx.post(w.url + "/debug/wedge", json={"seconds": 6}, timeout=5)
        t0 = time.monotonic()
        wait_for(lambda: w.get("/health").status_code == 503, 5, "/health to report the wedge")
        assert time.monotonic() - t0 < 3.5  # stall timeout 1.5 s plus polling
        assert w.get("/health").json()["status"] == "wedged"
        assert w.proc.poll() is None  # the process is alive: only health tells
        wait_for(lambda: w.get("/health").status_code == 200, 15, "recovery after the stall")
    finally:
        w.stop()


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.timeout(300)
def test_sigterm_drains_and_exits_zero(tiny_llama_dir):
    w = start_worker("both", tiny_llama_dir, "--tp", "2", "--drain-timeout", "3")
    c = PDClient(None, w)

    async def run():
        short = [asyncio.create_task(c.generate(f"s-{i}", [5, 6, 7], {"temperature": 0, "max_tokens": 4,
                                                                       "ignore_eos": True})) for i in range(16)]
        long = [asyncio.create_task(c.generate(f"l-{i}", [5, 6, 7], {"temperature": 0, "max_tokens": 400,
                                                                      "ignore_eos": True})) for i in range(16)]
        await until(c, w, lambda load: load["running"] >= 16, "the long requests decoding")
        os.kill(w.proc.pid, signal.SIGTERM)
        await until_health(c, w, "draining")
        refused = await c.http.post(w.url + "/generate", json={"request_id": "new", "prompt_ids": [1],
                                                               "params": {}})
        return await asyncio.gather(*short, *long, return_exceptions=True), refused
    results, refused = asyncio.run(asyncio.wait_for(run(), 120))
    assert refused.status_code == 503 and refused.headers.get("retry-after")
    for r in results:  # finished, or ended cleanly by the drain timeout
        assert not isinstance(r, BaseException), r
        assert r[1] in ("length", "abort"), r
    assert w.proc.wait(timeout=30) == 0
    # no orphan rank processes (spawn's resource tracker may take a moment to notice)
    wait_for(lambda: os.popen(f"pgrep -g {w.proc.pid}").read().split() == [], 10, "no orphans")
