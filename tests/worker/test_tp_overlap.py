"""Overlap scheduling across processes: a TP=2 colocated worker and a PD pair (TP=1), all with
`--overlap`, give the greedy tokens of the plain TP=1 engine; the TP ranks' digests stay equal
(`--check-divergence`), and every pool is full afterwards."""
from __future__ import annotations

import pytest

from .conftest import pool_full, ready, start_worker, stop_all, wait_for
from .test_tp import PROMPTS, assert_equal_greedy, reference, run_all


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_overlap_tp2_colocated_and_pd_equal_the_plain_engine(tiny_llama4_dir):
    both = start_worker("both", tiny_llama4_dir, "--tp", "2", "--check-divergence", "4", "--overlap", wait=False)
    prefill = start_worker("prefill", tiny_llama4_dir, "--overlap", wait=False)
    decode = start_worker("decode", tiny_llama4_dir, "--overlap", wait=False)
    workers = (both, prefill, decode)
    try:
        ref = reference(tiny_llama4_dir, PROMPTS)
        ready(*workers)
        assert_equal_greedy(tiny_llama4_dir, PROMPTS, run_all(None, both, PROMPTS, "ov"), ref)
        assert both.get("/health").status_code == 200  # no divergence was found
        assert_equal_greedy(tiny_llama4_dir, PROMPTS, run_all(prefill, decode, PROMPTS, "ovpd"), ref)
        wait_for(lambda: pool_full(both) and pool_full(prefill) and pool_full(decode), 20, "pools full")
    finally:
        stop_all(*workers)
