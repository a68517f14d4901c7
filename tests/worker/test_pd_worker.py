"""Prefill and decode workers exchange the KV over NIXL; outputs equal the engine alone."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

from .conftest import PDClient, pool_full, wait_for

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time",
           "List three colors:", "1 2 3 4 5", "Roses are red,"]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_pd_greedy_equals_engine_alone(pd_pair, default_model_dir):
    prefill, decode = pd_pair
    llm = LLM(EngineConfig(model=default_model_dir))
    ids = [llm.prompt_ids(p) for p in PROMPTS]
    ref = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))

    async def run():
        c = PDClient(prefill, decode)
        return await asyncio.gather(*(c.generate(f"eq-{i}", p, {"temperature": 0, "max_tokens": 16,
                                                               "ignore_eos": True})
                                      for i, p in enumerate(ids)))
    results = asyncio.run(run())
    for (tokens, reason, err), r in zip(results, ref):
        assert err is None and reason == "length"
        assert tokens == r.token_ids
    wait_for(lambda: pool_full(prefill) and pool_full(decode), what="both pools full")
