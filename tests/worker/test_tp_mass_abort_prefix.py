"""The mass abort of tests/worker/test_tp_mass_abort.py (PD, TP=2 on both sides) with the
prefix cache at work: the streams share a few system prompts, the prefill pool is small so that
its cached blocks are evicted to a host-memory tier and loaded back from it, both workers run the
plain loop (the overlapped one is the 300-stream case's, test_tp_mass_abort.py), and every
in-flight request is aborted at once while transfers are in flight — twice, with 100 streams each. No hang, no divergence (digests
are compared every 2 steps, and with that check on every rank checks the books of its pool and
host tier whenever it is idle), every room terminal, both pools full, and 50 requests sharing
the prefixes afterwards, sent twice (the second time partly from the host tier), give the
tokens of a cache-off engine."""
from __future__ import annotations

import asyncio
import random

import pytest

from .conftest import PDClient, pool_full, start_worker, wait_for
from .test_tp import GREEDY, assert_equal_greedy, reference, run_all
from .test_tp_mass_abort import abort_window, rooms_terminal

STREAMS = 100
ROUNDS = 2
# per rank: 1 MiB holds 128 blocks of the tiny model's KV shard (2 layers, 2 KV heads of 16,
# 16 tokens, fp32), fewer than the streams' prompts need: the prefill pool evicts to the host tier
FLAGS = ("--tp", "2", "--check-divergence", "2", "--max-num-seqs", "64")
# a small step budget makes the prefills take many steps, which keeps the window in which
# requests decode while other rooms wait for their KV open long enough to abort inside it
PREFILL_FLAGS = ("--kv-cache-memory", "1MiB", "--host-cache-memory", "1MiB", "--max-num-batched-tokens", "64")


def prompts(rng: random.Random, n: int, least: int = 5) -> list[list[int]]:
    """`n` prompts, each one of three 40-token system prompts, then `least` to 60 tokens of its own."""
    systems = [[rng.randrange(3, 320) for _ in range(40)] for _ in range(3)]
    return [systems[i % 3] + [rng.randrange(3, 320) for _ in range(rng.randint(least, 60))] for i in range(n)]


def metric(w, name: str) -> float:
    for line in w.get("/metrics").text.splitlines():
        if line.startswith(f"pdserve:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no pdserve:{name} on {w.url}")


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_mass_abort_with_shared_prefixes_and_a_host_tier_under_tp2_pd(tiny_llama4_dir):
    rng = random.Random(7)
    after = prompts(rng, 50, least=30)  # ≥ 4 blocks each: 50 of them overflow the prefill pool
    ref = reference(tiny_llama4_dir, after)  # the engine's default: no prefix cache
    # both start at once (their start-ups overlap), then are waited for
    prefill = start_worker("prefill", tiny_llama4_dir, *FLAGS, *PREFILL_FLAGS, wait=False)
    decode = start_worker("decode", tiny_llama4_dir, *FLAGS, wait=False)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        async def round_(k: int) -> None:
            c = PDClient(prefill, decode)
            batch = prompts(rng, STREAMS)
            tasks = [asyncio.create_task(c.generate(f"m{k}-{i}", p, {**GREEDY, "max_tokens": 100}))
                     for i, p in enumerate(batch)]
            # the abort comes while requests decode and rooms are still waiting for their KV
            assert await abort_window(c, decode, tasks, k + 1), "every request ended before the abort window opened"
            for t in tasks:  # every stream goes away at once
                t.cancel()
            await asyncio.gather(*(c.abort(f"m{k}-{i}") for i in range(STREAMS)))
            await asyncio.gather(*tasks, return_exceptions=True)

        for k in range(ROUNDS):
            asyncio.run(asyncio.wait_for(round_(k), 120))
            for w in (prefill, decode):
                assert w.get("/health").status_code == 200, w.get("/health").text
            wait_for(lambda: pool_full(prefill) and pool_full(decode), 60, f"pools full after round {k}")
            wait_for(lambda: rooms_terminal(prefill) and rooms_terminal(decode), 60, "rooms terminal")
        got = run_all(prefill, decode, after, prefix="after")
        assert_equal_greedy(tiny_llama4_dir, after, got, ref)
        # the same 50 again: the first ones' blocks were evicted by the last ones, into host memory
        got = run_all(prefill, decode, after, prefix="again")
        assert_equal_greedy(tiny_llama4_dir, after, got, ref)
        assert metric(prefill, "prefix_cache_host_hits_total") > 0, prefill.get("/info").json()
        # both tiers' metrics: the device evicted into the host tier, which now holds copies
        assert metric(prefill, "prefix_cache_evictions_total") > 0
        assert 0 < metric(prefill, "host_cache_blocks_used") <= metric(prefill, "host_cache_blocks_total")
        wait_for(lambda: pool_full(prefill) and pool_full(decode), 60, "pools full at the end")
        for w in (prefill, decode):  # no divergence, and the idle books balanced on every rank
            assert w.get("/health").status_code == 200, w.get("/health").text
    finally:  # a graceful stop is tested elsewhere
        prefill.kill()
        decode.kill()
