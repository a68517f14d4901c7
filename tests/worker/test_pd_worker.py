"""Prefill and decode workers exchange the KV over NIXL; outputs equal the engine alone."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve import worker_api as api
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

from .conftest import PDClient, pool_full, ready, start_worker, stop_all, wait_for

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "List three colors:",
           "1 2 3 4 5", "Roses are red,", "The quick brown fox", "Water boils at", "Dear Sir or Madam,",
           "import numpy as np\n", "In 1492, Columbus", "Q: What is 2+2?\nA:", "A list of fruits: apple,",
           "The mitochondria is the", "Translate to French: cat", "Hello"]


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_pd_and_colocated_greedy_and_seeded_equal_engine_alone(pd_pair, default_model_dir):
    """PD changes nothing: 16 prompts give the engine's greedy tokens through PD and colocated,
    and 4 seeded sampled ones its draws (in PD the first draw is the prefill worker's, the
    rest the decode worker's: a seed's draw number i is the same wherever it is made)."""
    prefill, decode = pd_pair
    both = start_worker("both", default_model_dir, wait=False)  # starts while the reference runs
    greedy = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
    seeded = [{"temperature": 0.9, "seed": 100 + i, "max_tokens": 16, "ignore_eos": True} for i in range(4)]

    async def run(p, d):
        c = PDClient(p, d)
        return await asyncio.gather(*(c.generate(f"eq-{i}", x, greedy) for i, x in enumerate(ids)),
                                    *(c.generate(f"seeded-{i}", x, s) for i, (x, s) in enumerate(zip(ids, seeded))))
    try:
        llm = LLM(EngineConfig(model=default_model_dir))
        ids = [llm.prompt_ids(p) for p in PROMPTS]
        ref = llm.generate(ids, SamplingParams(**greedy))
        ref += llm.generate(ids[:4], [SamplingParams(**s) for s in seeded])
        assert len({tuple(r.token_ids) for r in ref[16:]} | {tuple(r.token_ids) for r in ref[:4]}) == 8  # they sample
        ready(both)
        for results in (asyncio.run(run(prefill, decode)), asyncio.run(run(None, both))):
            for (tokens, reason, err), r in zip(results, ref, strict=True):
                assert err is None and reason == "length"
                assert tokens == r.token_ids
    finally:
        both.stop()
    wait_for(lambda: pool_full(prefill) and pool_full(decode), what="both pools full")


def metric(w, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(w.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_worker_metrics_count_what_happened(pd_pair):
    prefill, decode = pd_pair
    before = {w.role: (metric(w, "pdserve:request_success_total", finished_reason="length"),
                       metric(w, "pdserve:rooms_total", state="done"),
                       metric(w, "pdserve:generation_tokens_total")) for w in (prefill, decode)}

    async def run():
        c = PDClient(prefill, decode)
        return await asyncio.gather(*(c.generate(f"m-{i}", [5, 6, 7, 8 + i], {"temperature": 0, "max_tokens": 5,
                                                                            "ignore_eos": True})
                                      for i in range(4)))
    asyncio.run(run())
    wait_for(lambda: metric(decode, "pdserve:rooms_total", state="done") >= before["decode"][1] + 4, 5, "rooms")
    assert metric(decode, "pdserve:request_success_total", finished_reason="length") == before["decode"][0] + 4
    assert metric(decode, "pdserve:generation_tokens_total") == before["decode"][2] + 20
    assert metric(prefill, "pdserve:rooms_total", state="done") == before["prefill"][1] + 4
    assert metric(decode, "pdserve:scheduler_agree_seconds_count") > 0


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_prompt_ids_outside_the_vocabulary_are_a_400_and_disturb_nothing(pd_pair):
    """A prompt id past the embedding is refused at the door of both roles: it once reached the
    prefill worker's forward and failed every request there. A request in flight finishes intact,
    and the refused request id holds nothing (it can be used again at once)."""
    prefill, decode = pd_pair
    params = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}

    async def run():
        c = PDClient(prefill, decode)
        alone = await c.generate("vocab-ref", [5, 6, 7, 8], params)
        running = asyncio.create_task(c.generate("vocab-live", [5, 6, 7, 8], params))
        while (await c.http.get(decode.url + "/load")).json()["running"] == 0:
            await asyncio.sleep(0.01)
        bad = [1, 2, 49152]
        refusals = [
            await c.http.post(decode.url + "/generate", json=api.GenerateRequest(
                request_id="vocab-bad", prompt_ids=bad, params=api.SamplingParams(**params),
                prefill_url=prefill.url, prefill_worker_id=prefill.worker_id).wire()),
            await c.http.post(prefill.url + "/prefill", json=api.PrefillRequest(
                request_id="vocab-bad", prompt_ids=[-1, 2], params=api.SamplingParams(**params),
                decode=api.DecodeTarget(worker_id=decode.worker_id, decode_url=decode.url, blocks=[0])).wire()),
        ]
        again = await c.generate("vocab-bad", [5, 6, 7, 8], params)  # the refused id is free
        return alone, await running, refusals, again

    alone, live, refusals, again = asyncio.run(asyncio.wait_for(run(), 200))
    for r, bad_id in zip(refusals, (49152, -1)):
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "bad_request"
        assert f"prompt token id {bad_id} is outside the vocabulary [0, 49152)" in r.json()["error"]["message"]
    assert live == alone == again and alone[1] == "length" and len(alone[0]) == 48
    assert prefill.get("/health").json()["status"] == decode.get("/health").json()["status"] == "ok"
    wait_for(lambda: pool_full(prefill) and pool_full(decode), what="both pools full")


@pytest.mark.e2e
@pytest.mark.timeout(500)
def test_fp16_caches_move_as_they_are_and_a_peer_of_the_other_dtype_is_refused(pd_pair, default_model_dir):
    """--kv-cache-dtype float16 on both workers: the transfer moves fp16 blocks (half the bytes) and
    PD equals the fp16 engine alone; an fp32 prefill worker refuses an fp16 decode worker's room
    with the layout error, and both pools come back full."""
    prefill32, _ = pd_pair
    prefill, decode = ready(start_worker("prefill", default_model_dir, "--kv-cache-dtype", "float16", wait=False),
                            start_worker("decode", default_model_dir, "--kv-cache-dtype", "float16", wait=False))
    try:
        llm = LLM(EngineConfig(model=default_model_dir, kv_cache_dtype="float16"))
        ids = [llm.prompt_ids(p) for p in PROMPTS[:6]]
        ref = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        bytes_before = metric(prefill, "pdserve:kv_transfer_bytes_total")

        async def run():
            c = PDClient(prefill, decode)
            return await asyncio.gather(*(c.generate(f"h-{i}", x, {"temperature": 0, "max_tokens": 12,
                                                                   "ignore_eos": True})
                                          for i, x in enumerate(ids)))
        for (tokens, reason, err), r in zip(asyncio.run(run()), ref):
            assert err is None and reason == "length" and tokens == r.token_ids
        # 30 layers × K, V × 3 KV heads × 64 dims × 2 bytes × 16 tokens a block, every prompt block
        blocks = sum(-(-len(x) // 16) for x in ids)
        assert metric(prefill, "pdserve:kv_transfer_bytes_total") - bytes_before == blocks * 30 * 2 * 3 * 64 * 2 * 16

        async def mismatch():
            body = api.GenerateRequest(request_id="mix", prompt_ids=ids[0], prefill_url=prefill32.url,
                                       prefill_worker_id=prefill32.worker_id,
                                       params=api.SamplingParams(temperature=0, max_tokens=4))
            async with httpx.AsyncClient(timeout=60) as http:
                async with http.stream("POST", decode.url + "/generate", json=body.wire(),
                                       headers={"X-Request-Id": "mix"}) as r:
                    room = api.parse_line(await r.aiter_lines().__anext__()).room
                    target = api.DecodeTarget(worker_id=room.worker_id, decode_url=decode.url, blocks=room.blocks,
                                              cached_blocks=room.cached_blocks)
                    answer = await http.post(prefill32.url + "/prefill", headers={"X-Request-Id": "mix"},
                                             json=api.PrefillRequest(request_id="mix", prompt_ids=ids[0],
                                                                     params=body.params, decode=target).wire())
                    await http.post(decode.url + "/abort", json=api.AbortRequest(request_id="mix").wire())
                    return answer
        answer = asyncio.run(mismatch())
        assert answer.status_code != 200
        assert "bytes per block" in answer.json()["error"]["message"]
        # the prefill worker refused before connecting, so it cannot fence the room; the decode worker
        # holds the room's block until the fence lease (30 s, docs/kv-transfer.md) runs out
        assert pool_full(prefill32) and decode.get("/load").json()["transferring"] == 1
        wait_for(lambda: pool_full(decode), 45, what="the decode pool full once the lease ran out")
    finally:
        stop_all(prefill, decode)
