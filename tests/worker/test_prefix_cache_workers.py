"""The prefix cache in real workers: multi-turn conversations sharing a system prompt, TP=2,
colocated and PD (the prefill worker reuses its cache, the decode worker gets the prompt's KV
from it), give the greedy tokens of a cache-off engine for every prompt; the decode's last
line reports the prompt tokens the cache supplied (a repeated prompt: the KV its first run left,
bar its last token); in PD the decode worker keeps what it received too, so a later turn's room
asks the prefill worker only for the blocks it lacks (a repeated prompt: its last partial block),
and only those travel; a salted session reuses only its own blocks; after POST
/reset_prefix_cache on every worker nothing is reused; the divergence check never fires, and the
pools come back."""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from pdserve import worker_api as api
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

from .conftest import pool_full, ready, start_worker, stop_all, wait_for
from .test_pd_worker import metric
from .test_tp import near_tie

GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
BS = 16  # the workers' default block size


async def generate(http: httpx.AsyncClient, prefill, decode, rid: str, prompt: list[int],
                   cache_salt: str | None = None) -> tuple[list[int], int, api.Room | None]:
    """(tokens, cached_tokens, the decode worker's room) of one request, PD when `prefill` is given."""
    body = api.GenerateRequest(request_id=rid, prompt_ids=prompt,
                               params=api.SamplingParams(**GREEDY, cache_salt=cache_salt))
    if prefill is not None:
        body.prefill_url, body.prefill_worker_id = prefill.url, prefill.worker_id
    tokens, prefill_call, room = [], None, None
    async with http.stream("POST", decode.url + "/generate", json=body.wire()) as r:
        assert r.status_code == 200, await r.aread()
        async for text in r.aiter_lines():
            msg = api.parse_line(text)
            if isinstance(msg, api.RoomLine):
                room = msg.room
                target = api.DecodeTarget(worker_id=msg.room.worker_id, decode_url=decode.url,
                                          blocks=msg.room.blocks, cached_blocks=msg.room.cached_blocks)
                req = api.PrefillRequest(request_id=rid, prompt_ids=prompt, params=body.params, decode=target)
                prefill_call = asyncio.create_task(http.post(prefill.url + "/prefill", json=req.wire()))
                continue
            tokens += msg.token_ids
            if msg.finish_reason is not None:
                assert msg.error is None and msg.finish_reason.value == "length", msg
                if prefill_call is not None:  # the prefill worker's own count agrees
                    done = api.PrefillDone.model_validate((await prefill_call).json())
                    assert done.cached_tokens == msg.cached_tokens
                return tokens, msg.cached_tokens, room
    raise AssertionError("the stream ended without a finish")


def conversation(prefill, decode, sessions: int = 3, turns: int = 3, seed: int = 0):
    """Every turn resends the conversation so far; returns (prompt, tokens, cached, room) per
    request, the last session's last prompt sent again last. The last session sends a cache
    salt (the others share the system prompt's blocks; it reuses only its own). Also returns
    that repeat under another salt: nothing of it is cached there."""
    rng = random.Random(seed)
    salts = [None] * (sessions - 1) + [f"tenant-{seed}"]
    system = [rng.randrange(3, 300) for _ in range(50)]
    history = [list(system) for _ in range(sessions)]
    out = []

    async def go():
        async with httpx.AsyncClient(timeout=120) as http:
            for t in range(turns):
                for h in history:
                    h += [rng.randrange(3, 300) for _ in range(rng.randint(4, 12))]
                prompts = [list(h) for h in history]
                got = await asyncio.gather(*(generate(http, prefill, decode, f"c{seed}-{s}-{t}", p, salts[s])
                                             for s, p in enumerate(prompts)))
                for h, p, (tokens, cached, room) in zip(history, prompts, got):
                    out.append((p, tokens, cached, room))
                    h += tokens
            # the last prompt again: what its first run computed comes from the cache
            p = out[-1][0]
            out.append((p, *await generate(http, prefill, decode, f"c{seed}-again", p, salts[-1])))
            stranger.append((p, *await generate(http, prefill, decode, f"c{seed}-stranger", p, "another")))
    stranger: list = []
    asyncio.run(asyncio.wait_for(go(), 400))
    return out, stranger[0]


def reference(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=model_dir, prefix_cache=False))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(**GREEDY))
    out = {f"r{i}": [] for i in range(len(prompts))}
    for o in engine.run_until_done():
        if o.token_id is not None:
            out[o.request_id].append(o.token_id)
    return [out[f"r{i}"] for i in range(len(prompts))]


def check(model_dir: str, results, outputs_cached: int) -> None:
    """`outputs_cached`: how many output tokens' KV a request leaves in the worker that
    computed its prompt (a colocated worker's; none on a prefill worker)."""
    prompts = [p for p, _, _, _ in results]
    ref = reference(model_dir, prompts)
    for (p, tokens, _, _), r in zip(results, ref):
        assert tokens == r or near_tie(model_dir, p, tokens, r), (p, tokens, r)
    cached = [c for _, _, c, _ in results]
    assert min(cached[:3]) == 0  # the first request scheduled found nothing cached
    assert all(c > 0 for c in cached[3:])  # later turns reuse the conversation so far
    # the repeat of the last prompt: its full blocks; then, unless the first run filled the block
    # after them (then a shared full block, never written), the first run's tail: all but the last token
    n = len(prompts[-1])
    full = (n - 1) // BS
    assert cached[-1] == (full * BS if n + outputs_cached >= (full + 1) * BS else n - 1)


def check_stranger(results, stranger) -> None:
    """The last prompt sent again under a salt nobody used: computed whole, the same tokens."""
    p, tokens, cached, _ = stranger
    assert p == results[-1][0] and tokens == results[-1][1]
    assert cached == 0


def reset_then_again(prefill, decode, results, seed: int):
    """POST /reset_prefix_cache on every worker: the last prompt sent again under its session's
    salt is computed whole (nothing kept by the decode worker either), with the same tokens.
    Returns that request's (prompt, tokens, cached, room)."""
    for w in (w for w in (prefill, decode) if w is not None):
        r = httpx.post(w.url + "/reset_prefix_cache", timeout=60)
        assert r.status_code == 200 and r.json()["forgotten_blocks"] > 0, r.text
        forgotten = r.json()["forgotten_blocks"]
        wait_for(lambda w=w: metric(w, "pdserve:prefix_cache_forgotten_blocks_total") == forgotten, 20,
                 "the forgotten blocks counted")
    p, tokens = results[-1][0], results[-1][1]

    async def go():
        async with httpx.AsyncClient(timeout=120) as http:
            return await generate(http, prefill, decode, f"c{seed}-reset", p, f"tenant-{seed}")
    got, cached, room = asyncio.run(go())
    assert (got, cached) == (tokens, 0)
    assert room is None or room.cached_blocks == 0
    return p, got, cached, room


def check_rooms(results) -> None:
    """PD: each room holds the conversation's blocks the decode worker kept (its full blocks
    of earlier prompts and answers) and asks for the rest; the repeat of the last prompt asks
    only for its last partial block."""
    rooms = [room for _, _, _, room in results]
    assert min(r.cached_blocks for r in rooms[:3]) == 0  # the first room admitted found nothing kept
    assert all(r.cached_blocks > 0 for r in rooms[3:])   # later turns: the turns before
    for p, _, _, room in results:
        assert room.cached_blocks + len(room.blocks) == -(-len(p) // BS)
    n = len(results[-1][0])
    assert (rooms[-1].cached_blocks, len(rooms[-1].blocks)) == (n // BS, int(n % BS > 0))


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_multiturn_tp2_colocated_and_pd_equal_a_cache_off_engine(tiny_llama4_dir):
    flags = ("--tp", "2", "--check-divergence", "4")
    # the three workers start together: their start-ups overlap
    both, prefill, decode = workers = ready(*(start_worker(role, tiny_llama4_dir, *flags, wait=False)
                                              for role in ("both", "prefill", "decode")))
    try:
        results, stranger = conversation(None, both, seed=1)
        check(tiny_llama4_dir, results, GREEDY["max_tokens"] - 1)
        check_stranger(results, stranger)
        reset_then_again(None, both, results, seed=1)
        assert both.get("/health").status_code == 200  # no divergence was found
        wait_for(lambda: pool_full(both), 20, "pool full")
        results, stranger = conversation(prefill, decode, seed=2)
        check(tiny_llama4_dir, results, 0)
        check_rooms(results)
        check_stranger(results, stranger)
        assert stranger[3].cached_blocks == 0  # the decode worker kept nothing under its salt
        after_reset = reset_then_again(prefill, decode, results, seed=2)
        # what the prefill worker sent: the rooms' blocks, not the prompts' (2 layers × K, V × 4 KV
        # heads × 16 dims × fp32 × 16 tokens a block, over both ranks)
        sent = sum(len(room.blocks) for _, _, _, room in [*results, stranger, after_reset]) * 2 * 2 * 4 * 16 * 4 * BS
        wait_for(lambda: metric(prefill, "pdserve:kv_transfer_bytes_total") == sent, 20, "the bytes sent")
        assert prefill.get("/health").status_code == 200 and decode.get("/health").status_code == 200
        metrics = prefill.get("/metrics").text
        assert "pdserve:prefix_cache_hits_total" in metrics
        wait_for(lambda: pool_full(prefill) and pool_full(decode), 20, "pools full")
    finally:
        stop_all(*workers)
