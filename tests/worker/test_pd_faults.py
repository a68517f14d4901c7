"""PD under faults: an abort storm, a prefill worker killed mid-transfer, a decode worker killed.
After each: every room terminal, every KV block back in its pool, and the workers still serve.

A kill "mid-transfer" is made certain, not hoped for, with a fault plan (worker/faults.py):
the prefill worker holds back its victims' writes, so their rooms are open on both sides at
the kill; or the decode worker's rank stops polling its transfer agent, so the prefill
worker's writes into it stay in flight, which its own gauge (`pdserve:kv_writes_in_flight`)
shows before the kill."""
from __future__ import annotations

import asyncio
import os
import random
import re
import tempfile
import time

import httpx
import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.worker.faults import FaultPlan, RankFaults

from .conftest import PDClient, WorkerProc, pool_full, ready, start_worker, stop_all, wait_for

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "List three colors:",
           "1 2 3 4 5", "Roses are red,", "The quick brown fox", "Water boils at"]
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(default_model_dir):
    llm = LLM(EngineConfig(model=default_model_dir))
    ids = [llm.prompt_ids(p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(**GREEDY))
    return ids, [o.token_ids for o in outs]


def rooms_terminal(w) -> bool:
    return w.get("/load").json()["rooms_live"] == 0


async def metric(c: PDClient, w: WorkerProc, name: str) -> float:
    """One series of a worker's /metrics (its only one: the constant labels)."""
    text = (await c.http.get(w.url + "/metrics")).text
    m = re.search(rf"^pdserve:{name}{{[^}}]*}} (\S+)$", text, re.M)
    assert m, f"no pdserve:{name} in /metrics"
    return float(m.group(1))


async def until(pred, timeout: float, what: str) -> None:
    """Wait (inside the event loop) until the async `pred()` is true."""
    deadline = time.monotonic() + timeout
    while not await pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")  # pred's own asserts say more
        await asyncio.sleep(0.05)


def stalled_decode(model_dir: str, monkeypatch, *extra: str, wait: bool = True) -> tuple[WorkerProc, str]:
    """A decode worker that stops polling its transfer agent while the returned file exists."""
    stall = os.path.join(tempfile.mkdtemp(prefix="pdserve-stall-"), "stall")
    with monkeypatch.context() as m:
        for name, value in FaultPlan({0: RankFaults(stall_file=stall)}).to_env().items():
            m.setenv(name, value)
        return start_worker("decode", model_dir, *extra, wait=wait), stall


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_abort_storm_leaves_no_trace(pd_pair, reference):
    """200 concurrent requests, half cancelled at random moments: the rest are exact."""
    prefill, decode = pd_pair
    ids, ref = reference
    rng = random.Random(0)

    async def storm():
        c = PDClient(prefill, decode)
        tasks, cancel_at = [], {}
        for i in range(200):
            tasks.append(asyncio.create_task(c.generate(f"storm-{i}", ids[i % len(ids)], GREEDY)))
            if i % 2:
                cancel_at[i] = rng.uniform(0.0, 3.0)

        async def cancel(i: int, delay: float):
            await asyncio.sleep(delay)  # the storm's schedule: when this client leaves (no wait for a state)
            tasks[i].cancel()
            await c.abort(f"storm-{i}")
        await asyncio.gather(*(cancel(i, d) for i, d in cancel_at.items()))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        # the workers still serve new requests
        after = await c.generate("after-storm", ids[0], GREEDY)
        return results, after

    results, after = asyncio.run(asyncio.wait_for(storm(), 400))
    for i, r in enumerate(results):
        if i % 2 and isinstance(r, asyncio.CancelledError):
            continue  # cancelled: its stream went away (the cancel wins over any late line)
        tokens, reason, err = r  # kept, or done before its cancel: exact either way
        assert (err, reason) == (None, "length") and tokens == ref[i % len(ids)], (i, r)
    assert after[0] == ref[0]
    wait_for(lambda: pool_full(prefill) and pool_full(decode), 30, "both pools full")
    wait_for(lambda: rooms_terminal(prefill) and rooms_terminal(decode), 30, "all rooms terminal")
    assert decode.get("/health").status_code == 200 and prefill.get("/health").status_code == 200


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_prefill_killed_mid_transfer(default_model_dir, reference, monkeypatch):
    """Six rooms open on both sides when the prefill worker dies (it sampled their first tokens
    and holds their KV for the write; the decode worker holds their blocks): the decode
    worker's transfer layer fails exactly those six rooms for the dead peer, their requests end
    at once with an error that says the peer died (the router's 503), the decodes already running
    carry on, and every block comes back."""
    ids, ref = reference
    with monkeypatch.context() as m:
        for name, value in FaultPlan({0: RankFaults(hold_writes="victim-")}).to_env().items():
            m.setenv(name, value)
        prefill = start_worker("prefill", default_model_dir, wait=False)
    decode = start_worker("decode", default_model_dir, "--max-num-seqs", "8", wait=False)
    ready(prefill, decode)
    try:
        async def run():
            c = PDClient(prefill, decode)
            # long decodes already running before the kill
            running = [asyncio.create_task(c.generate(f"long-{i}", ids[i], {**GREEDY, "max_tokens": 48}))
                       for i in range(2)]
            await until(lambda: _load(c, decode, "running", 2), 60, "two requests decoding")
            victims = [asyncio.create_task(c.generate(f"victim-{i}", ids[i % 8] * 40, GREEDY))
                       for i in range(6)]
            await until(lambda: _load(c, prefill, "transferring", 6), 120, "6 rooms waiting for their write")
            assert (await c.http.get(decode.url + "/load")).json()["rooms_live"] == 6
            prefill.kill()
            killed_at = time.monotonic()
            ended = await asyncio.gather(*victims, return_exceptions=True)
            latency = time.monotonic() - killed_at
            # the transfer layer's count (refreshed every 0.1 s): six rooms were open when their
            # peer died
            await until(lambda: _metric_is(c, decode, "kv_rooms_failed_peer_dead_total", 6), 5,
                        "the decode worker to count 6 rooms failed for their dead peer")
            return await asyncio.gather(*running), ended, latency, c.last_lines
        running, victims, latency, last_lines = asyncio.run(asyncio.wait_for(run(), 300))
        for i, (tokens, reason, err) in enumerate(running):
            assert err is None and tokens[:8] == ref[i]  # decoding requests carry on
        for v in victims:
            assert not isinstance(v, BaseException) and v[1] == "error" and "KV transfer failed" in v[2], v
        assert [last_lines[f"victim-{i}"].peer_dead for i in range(6)] == [True] * 6
        assert latency < 2.0, f"affected requests took {latency:.2f}s to fail"
        wait_for(lambda: pool_full(decode), 30, "the decode pool full after the fence")
        # a new prefill worker (new port) registers and serves
        prefill = start_worker("prefill", default_model_dir)
        tokens, reason, err = asyncio.run(PDClient(prefill, decode).generate("fresh", ids[0], GREEDY))
        assert err is None and tokens == ref[0]
    finally:
        stop_all(prefill, decode)


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_decode_killed_frees_prefill_blocks(default_model_dir, reference, monkeypatch):
    """Writes in flight when the decode worker dies (its rank does not poll, so none completes;
    the prefill worker's own gauge shows them): every stream breaks, every /prefill call answers
    that the decode worker is gone (the router's 503, not a prefill fault), the prefill worker's
    writes drain and its blocks come back, and a new decode worker is served."""
    ids, ref = reference
    prefill = start_worker("prefill", default_model_dir, wait=False)
    decode, stall = stalled_decode(default_model_dir, monkeypatch, wait=False)
    ready(prefill, decode)
    open(stall, "w").close()
    try:
        async def run():
            c = PDClient(prefill, decode, keep_prefills=True)
            tasks = [asyncio.create_task(c.generate(f"d-{i}", ids[i % 8] * 30, {**GREEDY, "max_tokens": 64}))
                     for i in range(6)]
            await until(lambda: _metric_at_least(c, prefill, "kv_writes_in_flight", 1), 120, "a write in flight")
            decode.kill()
            t0 = time.monotonic()
            res = await asyncio.gather(*tasks, return_exceptions=True)
            latency = time.monotonic() - t0
            await asyncio.gather(*c.prefills)
            return res, latency, c.prefill_errors, len(c.prefills)
        res, latency, prefill_errors, prefills = asyncio.run(asyncio.wait_for(run(), 300))
        assert all(isinstance(r, httpx.TransportError) for r in res), res  # the decode stream broke
        assert latency < 2.0
        assert prefills and prefill_errors == {rid: (502, "decode_unreachable") for rid in prefill_errors} \
            and len(prefill_errors) == prefills, prefill_errors
        wait_for(lambda: pool_full(prefill), 40, "prefill blocks released")
        wait_for(lambda: re.search(r"^pdserve:kv_writes_in_flight\{[^}]*\} 0\.0$",
                                   prefill.get("/metrics").text, re.M), 10, "the writes drained")
        decode = start_worker("decode", default_model_dir)
        tokens, reason, err = asyncio.run(PDClient(prefill, decode).generate("fresh", ids[0], GREEDY))
        assert err is None and tokens == ref[0]
    finally:
        stop_all(prefill, decode)


async def _load(c: PDClient, w: WorkerProc, key: str, value: int) -> bool:
    return (await c.http.get(w.url + "/load")).json()[key] >= value


async def _metric_is(c: PDClient, w: WorkerProc, name: str, value: float) -> bool:
    return await metric(c, w, name) == value


async def _metric_at_least(c: PDClient, w: WorkerProc, name: str, value: float) -> bool:
    return await metric(c, w, name) >= value


async def _finished(c: PDClient, w: WorkerProc, reason: str) -> float:
    """How many requests ended on `w` with this finish reason (pdserve:request_success_total)."""
    text = (await c.http.get(w.url + "/metrics")).text
    m = re.search(rf'^pdserve:request_success_total{{finished_reason="{reason}",[^}}]*}} (\S+)$', text, re.M)
    assert m, f"no request_success_total for {reason}"
    return float(m.group(1))


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_a_room_the_decode_worker_aborted_ends_aborted_on_the_prefill_worker(default_model_dir, reference,
                                                                               monkeypatch):
    """The decode worker aborts a room (its client left) while the prefill worker still works on
    it: the prefill worker's request ends as aborted, not failed, whether the abort came before
    its KV write (the agent refuses the write: the prefill worker's loop was wedged while the
    abort arrived) or during it (the write is in flight: the decode worker does not poll). Only
    the decode worker is told: the /prefill call stays open, so the room is all the prefill
    worker hears of the abort. Before, both ended as `error` ("KV transfer failed")."""
    ids, ref = reference
    with monkeypatch.context() as m:
        for name, value in FaultPlan(debug_routes=True).to_env().items():  # POST /debug/wedge
            m.setenv(name, value)
        prefill = start_worker("prefill", default_model_dir, wait=False)
    decode, stall = stalled_decode(default_model_dir, monkeypatch, wait=False)
    ready(prefill, decode)
    try:
        async def abort_on_decode(c: PDClient, rid: str, prompt: list[int], started) -> tuple:
            before = [await _finished(c, prefill, r) for r in ("abort", "error")]
            task = asyncio.create_task(c.generate(rid, prompt, {**GREEDY, "max_tokens": 64}))
            await until(started, 120, f"{rid} under way on the prefill worker")
            await c.http.post(decode.url + "/abort", json={"request_id": rid, "origin": "client"})
            _, reason, _ = await task
            return before, reason

        async def run() -> None:
            c = PDClient(prefill, decode, keep_prefills=True)
            # the two agents know each other (a room's abort can reach the prefill worker)
            assert (await c.generate("first", ids[0], GREEDY))[0] == ref[0]
            # 1. before the write: the prefill worker's loop stalls as the request arrives
            await c.http.post(prefill.url + "/debug/wedge", json={"seconds": 8})
            before, reason = await abort_on_decode(
                c, "refused-0", ids[0] * 20, lambda: _load(c, prefill, "in_flight", 1))
            assert reason == "abort"
            await until(lambda: _finished_more(c, prefill, before), 120, "the prefill worker ended refused-0")
            assert [await _finished(c, prefill, r) for r in ("abort", "error")] == [before[0] + 1, before[1]]
            # 2. during the write: the decode worker stops polling, so the write stays in flight
            open(stall, "w").close()
            before, reason = await abort_on_decode(
                c, "inflight-0", ids[1] * 20, lambda: _metric_at_least(c, prefill, "kv_writes_in_flight", 1))
            assert reason == "abort"
            await until(lambda: _finished_more(c, prefill, before), 120, "the prefill worker ended inflight-0")
            assert [await _finished(c, prefill, r) for r in ("abort", "error")] == [before[0] + 1, before[1]]
            os.remove(stall)
            await asyncio.gather(*c.prefills)

        asyncio.run(asyncio.wait_for(run(), 400))
        wait_for(lambda: pool_full(prefill) and pool_full(decode), 40, "both pools full")
        wait_for(lambda: rooms_terminal(prefill) and rooms_terminal(decode), 40, "all rooms terminal")
        tokens, reason, err = asyncio.run(PDClient(prefill, decode).generate("fresh", ids[0], GREEDY))
        assert err is None and tokens == ref[0]
    finally:
        if os.path.exists(stall):
            os.remove(stall)
        stop_all(prefill, decode)


async def _finished_more(c: PDClient, w: WorkerProc, before: list[float]) -> bool:
    return [await _finished(c, w, r) for r in ("abort", "error")] != before
