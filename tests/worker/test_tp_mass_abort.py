"""The production scenario: PD with TP=2 on both sides, 300 concurrent streams, then every
in-flight request aborted at once while transfers are in flight — five times, with the decode
worker on the overlapped loop (--overlap: its forwards run while aborts and KV arrive; the plain
loop's mass abort runs in test_tp_mass_abort_prefix.py; a prefill worker with --overlap made
this test take 88 s instead of 53 s on a quiet machine, so it stays plain here). No hang, no divergence (digests
are compared every 2 steps), every room terminal, both pools full, and 50 new requests
afterwards give the right tokens. Also: rank-local transfer faults."""
from __future__ import annotations

import asyncio
import random

import pytest

from pdserve.worker.faults import FaultPlan, RankFaults

from .conftest import PDClient, pool_full, ready, start_worker, stop_all, wait_for
from .test_tp import GREEDY, PROMPTS, assert_equal_greedy, reference, run_all


def rooms_terminal(w) -> bool:
    return w.get("/load").json()["rooms_live"] == 0


async def abort_window(c: PDClient, decode, tasks: list[asyncio.Task], running: int) -> bool:
    """Wait until at least `running` requests decode on `decode` while rooms there still wait
    for their KV (read live from its scheduler: `transferring`): True. False if every request
    ended first, so an abort now would hit nothing in flight."""
    while True:
        load = (await c.http.get(decode.url + "/load")).json()
        if load["running"] >= running and load["transferring"] >= 1:
            return True
        if all(t.done() for t in tasks):
            return False
        await asyncio.sleep(0.02)


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_mass_abort_under_tp2_pd(tiny_llama4_dir):
    ref = reference(tiny_llama4_dir, PROMPTS)
    flags = ("--tp", "2", "--check-divergence", "2", "--max-num-seqs", "64")
    prefill, decode = ready(start_worker("prefill", tiny_llama4_dir, *flags, wait=False),
                            start_worker("decode", tiny_llama4_dir, *flags, "--overlap", wait=False))
    rng = random.Random(3)
    try:
        async def round_(k: int) -> None:
            c = PDClient(prefill, decode)
            # the abort must come while requests decode and rooms still wait for their KV; a
            # batch that drains before the poll sees that moment (it happens on a fast, quiet
            # machine) proves nothing, so another batch is sent, up to three
            for attempt in range(3):
                ids = [f"m{k}-{attempt}-{i}" for i in range(300)]
                tasks = [asyncio.create_task(c.generate(rid, PROMPTS[i % len(PROMPTS)] * rng.randint(1, 6),
                                                        {**GREEDY, "max_tokens": 200}))
                         for i, rid in enumerate(ids)]
                if await abort_window(c, decode, tasks, k + 1):
                    break
                await asyncio.gather(*tasks)
            else:
                raise AssertionError(f"round {k}: three batches of 300 ended before the abort window opened")
            health = await c.http.get(decode.url + "/health")
            assert health.status_code == 200, health.text
            for t in tasks:  # the client side of a mass abort: every stream goes away at once
                t.cancel()
            await asyncio.gather(*(c.abort(rid) for rid in ids))
            await asyncio.gather(*tasks, return_exceptions=True)

        for k in range(5):
            asyncio.run(asyncio.wait_for(round_(k), 300))
            for w in (prefill, decode):
                assert w.get("/health").status_code == 200, w.get("/health").text
            wait_for(lambda: pool_full(prefill) and pool_full(decode), 60, f"pools full after round {k}")
            wait_for(lambda: rooms_terminal(prefill) and rooms_terminal(decode), 60, "rooms terminal")
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(50)]
        got = run_all(prefill, decode, prompts, prefix="after")
        assert_equal_greedy(tiny_llama4_dir, prompts, got, [ref[i % len(PROMPTS)] for i in range(50)])
    finally:
        stop_all(prefill, decode)


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_rank_local_transfer_faults_do_not_diverge(tiny_llama4_dir, monkeypatch):
    """Decode rank 1 fails some rooms' transfers, delays others and polls late: each room ends
    the same on both ranks, nothing diverges, nothing hangs."""
    ref = reference(tiny_llama4_dir, PROMPTS)
    faults = FaultPlan({1: RankFaults(fail_rooms="victim-", delay_rooms="late-", delay_s=1.0, poll_delay_s=0.01)})
    flags = ("--tp", "2", "--check-divergence", "1")
    prefill = start_worker("prefill", tiny_llama4_dir, *flags, wait=False)
    for name, value in faults.to_env().items():
        monkeypatch.setenv(name, value)
    prefill, decode = ready(prefill, start_worker("decode", tiny_llama4_dir, *flags, wait=False))
    try:
        async def go():
            c = PDClient(prefill, decode)
            jobs = [c.generate(f"{kind}-{i}", p, GREEDY) for i, p in enumerate(PROMPTS)
                    for kind in ("victim", "late", "ok")]
            return await asyncio.gather(*jobs)
        results = asyncio.run(asyncio.wait_for(go(), 300))
        served, got = [], []
        for n, (tokens, reason, err) in enumerate(results):
            i, kind = divmod(n, 3)
            if kind == 0:  # failed on rank 1 only: the request fails, on both ranks alike
                assert reason == "error" and "injected fault" in err, (n, reason, err)
            else:  # delayed or untouched: the greedy tokens of TP=1, to the last one
                assert err is None and reason == "length", (n, reason, err)
                served.append(PROMPTS[i])
                got.append(tokens)
        assert_equal_greedy(tiny_llama4_dir, served, got, [ref[PROMPTS.index(p)] for p in served])
        wait_for(lambda: pool_full(prefill) and pool_full(decode), 60, "pools full")
        for w in (prefill, decode):
            assert w.get("/health").status_code == 200  # the digests never differed
    finally:
        stop_all(prefill, decode)
