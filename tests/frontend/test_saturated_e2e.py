"""Busy is not dead, on a saturated machine: `pdserve serve --tp 3` (six rank processes and the
router on a machine with fewer cores), two rounds of 48 streams all dropped by their clients at
once. After each round a fresh request is served within a bounded time, never with a 503; no
worker is taken out of rotation while it is stepping; the pools are full at the end."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.frontend.conftest import start_server, stop_server

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

ROUNDS = 2
STREAMS = 48
FRESH_BOUND_S = 60.0   # a fresh request after a mass abort, on two shared cores
CHAT = "/chat/completions"


async def mass_abort(v1: str) -> int:
    """Open STREAMS streams, wait for each one's first event, then drop them all at once;
    returns how many got their first event."""
    async with httpx.AsyncClient(base_url=v1, timeout=300) as http:
        started = asyncio.Event()
        seen = 0
        stop = asyncio.Event()

        async def one(i: int) -> None:
            nonlocal seen
            body = {"messages": [{"role": "user", "content": f"Tell me a long story, number {i}."}],
                    "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with http.stream("POST", CHAT, json=body) as r:
                assert r.status_code == 200, (r.status_code, await r.aread())
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if seen == STREAMS:
                            started.set()
                        await stop.wait()
                        return  # the client drops its stream

        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        try:
            await asyncio.wait_for(started.wait(), 300)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        return seen


@pytest.mark.timeout(1500)
def test_mass_aborts_on_a_saturated_machine_then_fresh_requests_are_served_without_503(tmp_path):
    log = tmp_path / "serve.log"
    server = start_server("--mode", "pd", "--tp", "3", log_path=log)
    try:
        for _ in range(ROUNDS):
            assert asyncio.run(mass_abort(server.v1)) == STREAMS
            started = time.monotonic()
            r = httpx.post(server.v1 + CHAT, json={"messages": [{"role": "user", "content": "Say hi."}],
                                                   "max_tokens": 4}, timeout=FRESH_BOUND_S)
            took = time.monotonic() - started
            assert r.status_code == 200, r.text
            assert took < FRESH_BOUND_S, took
        text = log.read_text()
        assert "out of rotation" not in text, [ln for ln in text.splitlines() if "out of rotation" in ln]
        workers = {w["role"]: w["url"] for w in httpx.get(server.url + "/ready", timeout=10).json()["workers"]}
        deadline = time.monotonic() + 60
        while True:
            loads = [httpx.get(u + "/load", timeout=10).json() for u in workers.values()]
            if all(ld["free_blocks"] == ld["total_blocks"] and ld["in_flight"] == 0 for ld in loads):
                break
            assert time.monotonic() < deadline, loads
            time.sleep(0.25)
    finally:
        assert stop_server(server.proc, 120) == 0
