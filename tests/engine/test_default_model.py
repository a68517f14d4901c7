"""The default model (SmolLM2-135M-Instruct): greedy decoding equals transformers, batching
changes nothing, stop strings are cut, and the CLI answers."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
]

MIXED_PROMPTS = [
    "Hello", "The quick brown fox", "Once upon a time in a land far away, there lived",
    "1, 2, 3, 4,", "def fibonacci(n):", "Paris is", "The meaning of life is",
    "Translate to French: cat", "A list of fruits: apple, banana,", "Q: What is 2+2?\nA:",
    "In 1492, Columbus", "Dear Sir or Madam,", "The mitochondria is the", "import numpy as np\n",
    "Roses are red, violets are blue,", "Water boils at",
]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(EngineConfig(model=default_model_dir))


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_greedy(ours: list[int], ref: list[int], prompt_ids: list[int], model) -> None:
    """Equal tokens, or a divergence right after a near-tie (top-2 logit margin < 1e-3)."""
    i = first_divergence(ours, ref)
    if i is None:
        return
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ref[:i]])).logits[0, -1]
    top2 = logits.topk(2).values
    margin = float(top2[0] - top2[1])
    assert margin < 1e-3, f"tokens differ at position {i} with a top-2 margin of {margin}"


def test_greedy_equals_transformers_on_chat_prompts(llm, hf_model):
    # min_tokens masks EOS exactly as transformers' min_new_tokens does
    params = SamplingParams(temperature=0, max_tokens=64, min_tokens=64)
    prompt_ids = [llm.prompt_ids(p, chat=True) for p in CHAT_PROMPTS]
    ours = llm.generate(prompt_ids, params)
    for ids, c in zip(prompt_ids, ours):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                    min_new_tokens=64)[0, len(ids):].tolist()
        assert len(c.token_ids) == 64
        assert_same_greedy(c.token_ids, ref, ids, hf_model)


def test_capital_of_france_is_paris(llm):
    c, = llm.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=32),
                      chat=True)
    assert "Paris" in c.text
    assert c.finish_reason == "stop"  # ends on <|im_end|>


def test_converted_gguf_logits_equal_transformers(llm, hf_model, all_logits):
    ids = llm.prompt_ids("The history of the Roman empire", chat=False)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    ours = all_logits(llm.engine.model, ids, block_size=16)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()


def test_batch_invariance_with_chunked_prefill_and_preemption(default_model_dir, hf_model):
    # 24 blocks of 16 tokens cannot hold 16 sequences of 25-36 tokens: forces preemption
    small = LLM(EngineConfig(model=default_model_dir, kv_cache_memory=24 * 16 * 30 * 2 * 3 * 64 * 4,
                             max_num_batched_tokens=64, max_num_seqs=16))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [small.prompt_ids(p) for p in MIXED_PROMPTS]
    alone = [small.generate([p], params)[0].token_ids for p in ids]
    preempted_before = _preemptions(small)
    together = small.generate(ids, params)
    assert _preemptions(small) > preempted_before, "the small pool should have forced preemption"
    for p, a, t in zip(ids, alone, together):
        assert_same_greedy(t.token_ids, a, p, hf_model)
    assert small.engine.allocator.num_free == small.engine.pool.num_blocks


def _preemptions(llm: LLM) -> int:
    return llm.engine.scheduler.num_preemptions


def test_stop_strings_cut_the_output(llm):
    params = SamplingParams(temperature=0, max_tokens=40)
    full, = llm.generate(["What is the capital of France?"], params, chat=True)
    word = full.text.split()[2]
    cut, = llm.generate(["What is the capital of France?"],
                        SamplingParams(temperature=0, max_tokens=40, stop=[word]), chat=True)
    assert word not in cut.text
    assert full.text.startswith(cut.text)
    assert cut.text == full.text[:full.text.index(word)]
    assert cut.finish_reason == "stop"


def test_cli_generate_streams_only_text(default_model_dir):
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--model", default_model_dir,
                          "--chat", "--max-tokens", "24", "What is the capital of France?"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "INFO" not in out.stdout and "INFO" in out.stderr
