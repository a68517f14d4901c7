"""A dead peer's rooms fail at once (issue 20): POST /peers/dead on a decode worker, in-process
(its real engine, transfer agent and API; no prefill worker: one that died before it ever wrote
looks exactly like one that never came), with the tiny Llama.

* Rooms waiting for the dead prefill worker's KV fail: their streams end with an error, and an
  aborted room that still held its blocks (no fence could come from the dead writer) is fenced:
  every block is back within 2 s of the notice, not after the 30 s fence lease.
* A late notice about an older process of the same worker id spares the rooms made for its
  restarted successor (the incarnation in the notice and in the room's call differ)."""
from __future__ import annotations

import asyncio
import os
import re
import time

import httpx
import pytest

from pdserve import worker_api as api
from pdserve.engine.config import EngineConfig
from pdserve.worker.server import build_app
from pdserve.worker.worker import Worker, WorkerSettings

os.environ.setdefault("UCX_NET_DEVICES", "lo")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

WITHIN_S = 2.0
PROMPT = list(range(3, 40))  # 37 tokens: 3 blocks of 16


@pytest.fixture(scope="module")
def decode(tiny_llama_dir):
    worker = Worker(EngineConfig(model=tiny_llama_dir, kv_cache_memory=1 << 20, max_num_seqs=8),
                    WorkerSettings("decode", worker_id="decode-under-test"))
    worker.start()
    yield worker, build_app(worker, "tiny")
    worker.stop()


async def _generate(http: httpx.AsyncClient, rid: str, incarnation: str) -> api.TokenLine:
    body = api.GenerateRequest(request_id=rid, prompt_ids=PROMPT, params=api.SamplingParams(max_tokens=4),
                               prefill_worker_id="prefill-7", prefill_incarnation=incarnation)
    r = await http.post("/generate", json=body.wire())
    assert r.status_code == 200, r.text
    last = api.parse_line(r.text.splitlines()[-1])
    assert isinstance(last, api.TokenLine) and last.finish_reason is not None
    return last


async def _until(what: str, cond, timeout_s: float = 10.0) -> float:
    """Wait for `cond()`; returns when it held (monotonic)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)
    return time.monotonic()


def _failed_for_dead_peer(worker: Worker) -> float:
    """pdserve:kv_rooms_failed_peer_dead_total, as /metrics shows it (refreshed every 0.1 s)."""
    found = re.search(r"^pdserve:kv_rooms_failed_peer_dead_total\{[^}]*\} (\S+)$", worker.metrics.render().decode(), re.M)
    return float(found.group(1)) if found else 0.0


def test_rooms_of_a_dead_prefill_worker_fail_and_their_blocks_come_back_at_once(decode):
    worker, app = decode
    sched = worker.engine.scheduler
    total = sched.allocator.num_blocks

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://decode") as http:
            old = [asyncio.create_task(_generate(http, f"old-{i}", "incarnation-1")) for i in range(2)]
            gone = asyncio.create_task(_generate(http, "aborted-0", "incarnation-1"))
            new = asyncio.create_task(_generate(http, "new-0", "incarnation-2"))
            await _until("4 rooms waiting for their KV", lambda: len(sched.held) == 4)
            per_room = (total - sched.allocator.num_free) // 4
            # the router gave up on one: it ends, but its blocks wait for a fence its dead writer never sends
            assert (await http.post("/abort", json={"request_id": "aborted-0"})).status_code == 200
            assert (await gone).finish_reason is api.FinishReason.ABORT
            assert sched.allocator.num_free == total - 4 * per_room

            # a late notice about an older process of that worker id: nothing of ours is its
            r = await http.post("/peers/dead", json={"worker_id": "prefill-7", "incarnation": "incarnation-0"})
            assert r.json() == {"ok": True, "rooms": 0}

            told = time.monotonic()
            r = await http.post("/peers/dead", json={"worker_id": "prefill-7", "incarnation": "incarnation-1",
                                                     "reason": "the prefill worker was killed by SIGKILL"})
            assert r.json() == {"ok": True, "rooms": 3}  # the two waiting and the aborted one
            r = await http.post("/peers/dead", json={"worker_id": "prefill-7", "incarnation": "incarnation-1"})
            assert r.json()["rooms"] == 0  # a repeated notice: settled
            ends = await asyncio.wait_for(asyncio.gather(*old), WITHIN_S)
            failed = time.monotonic() - told
            for end in ends:
                assert end.finish_reason is api.FinishReason.ERROR
                assert "the prefill worker was killed by SIGKILL" in end.error
            freed = await _until("every block but new-0's is free",
                                 lambda: sched.allocator.num_free == total - per_room, WITHIN_S) - told
            # the room of the restarted process waits on, untouched
            assert not new.done() and list(sched.held) == ["new-0"]
            await _until("the two failed rooms counted", lambda: _failed_for_dead_peer(worker) == 2)

            r = await http.post("/peers/dead", json={"worker_id": "prefill-7", "incarnation": "incarnation-2"})
            assert r.json()["rooms"] == 1
            assert (await asyncio.wait_for(new, WITHIN_S)).finish_reason is api.FinishReason.ERROR
            await _until("the pool is full", lambda: sched.allocator.num_free == total, WITHIN_S)
            print(f"notice → rooms failed {failed * 1000:.0f} ms, blocks back {freed * 1000:.0f} ms")

    asyncio.run(run())
