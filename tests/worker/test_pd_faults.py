"""PD under faults: an abort storm, a prefill worker killed mid-transfer, a decode worker killed.
After each: every room terminal, every KV block back in its pool, and the workers still serve."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

from .conftest import PDClient, pool_full, start_worker, wait_for

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
            await asyncio.sleep(delay)
            tasks[i].cancel()
            await c.abort(f"storm-{i}")
        await asyncio.gather(*(cancel(i, d) for i, d in cancel_at.items()))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        # the workers still serve new requests
        after = await c.generate("after-storm", ids[0], GREEDY)
        return results, after

    results, after = asyncio.run(asyncio.wait_for(storm(), 400))
    for i, r in enumerate(results):
        if i % 2 == 0:
            tokens, reason, err = r
            assert err is None, (i, err)
            assert tokens == ref[i % len(ids)], i
        elif not isinstance(r, BaseException):
            tokens, reason, err = r  # finished before its cancel: still exact or cleanly ended
            assert reason in ("length", "abort", "error")
    assert after[0] == ref[0]
    wait_for(lambda: pool_full(prefill) and pool_full(decode), 30, "both pools full")
    wait_for(lambda: rooms_terminal(prefill) and rooms_terminal(decode), 30, "all rooms terminal")
    assert decode.get("/health").status_code == 200 and prefill.get("/health").status_code == 200


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_prefill_killed_mid_transfer(default_model_dir, reference):
    ids, ref = reference
    prefill = start_worker("prefill", default_model_dir)
    decode = start_worker("decode", default_model_dir, "--max-num-seqs", "8")
    try:
        async def run():
            c = PDClient(prefill, decode)
            # long decodes already running before the kill
            running = [asyncio.create_task(c.generate(f"long-{i}", ids[i], {**GREEDY, "max_tokens": 48}))
                       for i in range(2)]
            await asyncio.sleep(1.5)
            victims = [asyncio.create_task(c.generate(f"victim-{i}", ids[i % 8] * 40, GREEDY))
                       for i in range(6)]
            await asyncio.sleep(0.3)
            prefill.kill()
            killed_at = time.monotonic()
            ended = await asyncio.gather(*victims, return_exceptions=True)
            ended_at = time.monotonic()
            return await asyncio.gather(*running), ended, ended_at - killed_at
        running, victims, latency = asyncio.run(asyncio.wait_for(run(), 300))
        for i, (tokens, reason, err) in enumerate(running):
            assert err is None and tokens[:8] == ref[i]  # decoding requests carry on
        for v in victims:
            assert isinstance(v, BaseException) or v[1] in ("error", "length"), v
        assert latency < 2.0, f"affected requests took {latency:.2f}s to fail"
        wait_for(lambda: pool_full(decode), 30, "the decode pool full after the fence")
        # a new prefill worker (new port) registers and serves
        prefill = start_worker("prefill", default_model_dir)
        tokens, reason, err = asyncio.run(PDClient(prefill, decode).generate("fresh", ids[0], GREEDY))
        assert err is None and tokens == ref[0]
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_decode_killed_frees_prefill_blocks(default_model_dir, reference):
    ids, ref = reference
    prefill = start_worker("prefill", default_model_dir)
    decode = start_worker("decode", default_model_dir)
    try:
        async def run():
            c = PDClient(prefill, decode)
            tasks = [asyncio.create_task(c.generate(f"d-{i}", ids[i % 8] * 30, {**GREEDY, "max_tokens": 64}))
                     for i in range(6)]
            await asyncio.sleep(2.0)
            decode.kill()
            t0 = time.monotonic()
            res = await asyncio.gather(*tasks, return_exceptions=True)
            return res, time.monotonic() - t0
        res, latency = asyncio.run(asyncio.wait_for(run(), 300))
        assert all(isinstance(r, BaseException) or r[1] == "error" or r[1] == "length" for r in res)
        assert latency < 2.0
        wait_for(lambda: pool_full(prefill), 40, "prefill blocks released")
        decode = start_worker("decode", default_model_dir)
        tokens, reason, err = asyncio.run(PDClient(prefill, decode).generate("fresh", ids[0], GREEDY))
        assert err is None and tokens == ref[0]
    finally:
        prefill.stop()
        decode.stop()
