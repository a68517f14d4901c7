"""GLM-5 (MLA + MoE + DSA) under tensor parallelism: PD with TP=2 — attention and indexer heads
split, experts placed whole on ranks, latents and index keys sent rank to rank — gives the
greedy tokens of TP=1. The model shares its indexer (layers F S F), so the pool's layers differ:
the middle one keeps no index keys, and the transfer moves what each layer has."""
from __future__ import annotations

import pytest

from .conftest import pool_full, ready, start_worker, stop_all, wait_for
from .test_tp import assert_equal_greedy, reference, run_all

# longer than index_topk (16), so the top-k choice and the transferred index keys matter
PROMPTS = [[5, 17, 99, 4, 8, 150, 33, 71, 12, 9, 200, 3, 3, 8, 61, 7, 12, 40, 41, 42, 90],
           list(range(10, 50)), [42] * 9, [1, 2, 3]]


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_glm5_tp2_equals_tp1(deepseek_dir):
    model = deepseek_dir("glm-5-shared")
    ref = reference(model, PROMPTS)
    flags = ("--tp", "2", "--check-divergence", "4")
    prefill, decode = ready(start_worker("prefill", model, *flags, wait=False),
                            start_worker("decode", model, *flags, wait=False))
    try:
        assert_equal_greedy(model, PROMPTS, run_all(prefill, decode, PROMPTS), ref)
        wait_for(lambda: pool_full(prefill) and pool_full(decode), 20, "pools full")
        # no divergence between the ranks of either worker
        assert prefill.get("/health").status_code == 200 and decode.get("/health").status_code == 200
    finally:
        stop_all(prefill, decode)
