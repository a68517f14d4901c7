"""The default model (SmolLM2-135M-Instruct): greedy decoding equals transformers, batching
changes nothing, stop strings are cut, and the CLI answers.

Greedy sequences are checked by teacher forcing: one forward of the reference over prompt + our
tokens gives its greedy choice at every position at once."""
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


def assert_greedy_under(ours: list[int], logits: torch.Tensor, banned: tuple[int, ...] = ()) -> None:
    """Each of `ours` is the argmax of `logits` (row i predicts token i; `banned` tokens masked),
    or within 1e-3 of it (a near-tie). Teacher forcing: if every token is the reference's greedy
    choice given the tokens before it, the whole sequence is the reference's greedy sequence."""
    logits = logits.clone()
    logits[:, list(banned)] = float("-inf")
    best = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(ours)[:, None])[:, 0]
    gap = best - chosen
    bad = (gap >= 1e-3).nonzero()
    assert len(bad) == 0, f"token {int(bad[0])} is not greedy: {float(gap[bad[0]])} below the top logit"


def test_greedy_equals_transformers_on_chat_prompts(llm, hf_model):
    # min_tokens masks EOS exactly as transformers' min_new_tokens does
    params = SamplingParams(temperature=0, max_tokens=64, min_tokens=64)
    prompt_ids = [llm.prompt_ids(p, chat=True) for p in CHAT_PROMPTS]
    ours = llm.generate(prompt_ids, params)
    eos = hf_model.generation_config.eos_token_id
    eos = tuple(eos) if isinstance(eos, list) else (eos,)
    for ids, c in zip(prompt_ids, ours):
        assert len(c.token_ids) == 64
        # one forward over prompt + our tokens equals transformers' greedy generate token by token
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids + c.token_ids])).logits[0, len(ids) - 1:-1]
        assert_greedy_under(c.token_ids, ref, banned=eos)


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


def test_batch_invariance_with_chunked_prefill_and_preemption(default_model_dir, all_logits):
    # 24 blocks of 16 tokens cannot hold 16 sequences of 25-36 tokens: forces preemption
    small = LLM(EngineConfig(model=default_model_dir, kv_cache_memory=24 * 16 * 30 * 2 * 3 * 64 * 4,
                             max_num_batched_tokens=64, max_num_seqs=16))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [small.prompt_ids(p) for p in MIXED_PROMPTS]
    preempted_before = _preemptions(small)
    together = small.generate(ids, params)
    assert _preemptions(small) > preempted_before, "the small pool should have forced preemption"
    # alone: the same model runs each sequence by itself, with nothing else in its batch (one
    # forward over prompt + tokens: the greedy choice at every position without 24 decode steps)
    for p, t in zip(ids, together):
        assert len(t.token_ids) == 24
        alone = all_logits(small.engine.model, p + t.token_ids, block_size=16)[len(p) - 1:-1]
        assert_greedy_under(t.token_ids, alone)
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
