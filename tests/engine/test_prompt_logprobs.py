"""Prompt logprobs in the engine (the default model): equal to a log-softmax of transformers'
logits on the same weights, across chunked prefill, beside a request that does not ask for
them, and never from the prefix cache (such a request computes every position)."""
from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

TOP = 3
TEXT = ("The history of the Roman empire begins with the founding of the city, and its long "
        "decline ends with the fall of Constantinople in 1453.")


@pytest.fixture(scope="module")
def engine(default_model_dir):
    # 16 tokens a step: a 30-token prompt is prefilled in chunks
    return LLMEngine(EngineConfig(model=default_model_dir, max_num_batched_tokens=16, block_size=16))


@pytest.fixture(scope="module")
def prompt(default_model_dir) -> list[int]:
    from pdserve.tokenizer import Tokenizer

    ids = Tokenizer(default_model_dir).encode(TEXT)
    assert len(ids) > 16 * 1.5
    return ids


@pytest.fixture(scope="module")
def reference(default_model_dir, prompt) -> torch.Tensor:
    """transformers' log-softmax at every position of the prompt ([len - 1, vocab]: position p
    predicts token p + 1)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def run(engine: LLMEngine, requests: dict[str, SamplingParams], prompt: list[int]) -> dict[str, list]:
    """Every output of each request, run together to the end."""
    for rid, params in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    for o in engine.run_until_done():
        outs[o.request_id].append(o)
    return outs


def assert_matches(entries, prompt: list[int], reference: torch.Tensor) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for p, e in enumerate(entries[1:]):
        assert e.token_id == prompt[p + 1]
        assert abs(e.logprob - float(reference[p, e.token_id])) < 1e-4, (p, e.logprob)
        ref_top = reference[p].topk(TOP)
        assert [t for t, _ in e.top] == ref_top.indices.tolist(), p
        assert max(abs(v - r) for (_, v), r in zip(e.top, ref_top.values.tolist())) < 1e-4


def test_prompt_logprobs_equal_transformers_across_chunks(engine, prompt, reference):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = run(engine, {"plain": greedy, "scored": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                  prompt_logprobs=TOP)}, prompt)
    first = outs["scored"][0]
    assert_matches(first.prompt_logprobs, prompt, reference)
    assert all(o.prompt_logprobs is None for o in outs["scored"][1:] + outs["plain"])
    # asking for them changes nothing else: the same greedy tokens as the request beside it
    assert [o.token_id for o in outs["scored"]] == [o.token_id for o in outs["plain"]]


def test_prompt_logprobs_never_come_from_the_prefix_cache(engine, prompt, reference):
    warm = run(engine, {"warm": SamplingParams(temperature=0, max_tokens=1)}, prompt)["warm"]
    again = run(engine, {"again": SamplingParams(temperature=0, max_tokens=1)}, prompt)["again"]
    assert again[-1].cached_tokens > 0  # the prompt's blocks are cached
    scored = run(engine, {"scored2": SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP)},
                 prompt)["scored2"]
    assert scored[-1].cached_tokens == 0
    assert_matches(scored[0].prompt_logprobs, prompt, reference)
    assert warm[0].token_id == scored[0].token_id
    engine.allocator.check_integrity()
    assert engine.allocator.num_used == 0
