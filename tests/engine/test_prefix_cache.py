"""The prefix cache in the engine (colocated): multi-turn conversations give the same greedy
tokens with the cache on as with it off, and a later turn reuses all its conversation's KV (its
partly filled last block too); a repeated prompt reports all but its last block as cached;
eviction under a small pool keeps the books exact and the outputs unchanged."""
from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

BS = 4


def make_engine(model_dir: str, cache: bool, blocks: int = 256, host_blocks: int = 0,
                device: str = "cpu", kv: str = "auto") -> LLMEngine:
    # tiny_llama: 2 layers × (K, V) × 2 KV heads × 16 dims × 4 bytes (2 with an fp16 cache) per token
    per_block = BS * 2 * 2 * 2 * 16 * (2 if kv == "float16" else 4)
    return LLMEngine(EngineConfig(model=model_dir, block_size=BS, kv_cache_memory=blocks * per_block,
                                  max_num_batched_tokens=32, max_num_seqs=8, prefix_cache=cache,
                                  host_cache_memory=host_blocks * per_block, device=device, dtype="float32",
                                  kv_cache_dtype=kv))


def generate(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int = 6, cache_salt: str | None = None
             ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Greedy tokens and reported cached tokens of each request, run together to the end."""
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                  cache_salt=cache_salt))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    for o in engine.run_until_done():
        if o.token_id is not None:
            tokens[o.request_id].append(o.token_id)
        if o.finish_reason is not None:
            cached[o.request_id] = o.cached_tokens
        engine.allocator.check_integrity()
    return tokens, cached


def conversation(engine: LLMEngine, sessions: int, turns: int, system: list[int], seed: int
                 ) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """`sessions` conversations of `turns` turns sharing a system prompt; every turn resends the
    conversation so far. Returns the prompts, the outputs, and each request's cached tokens."""
    rng = random.Random(seed)
    history = [list(system) for _ in range(sessions)]
    prompts, outputs, cached = [], [], []
    for t in range(turns):
        batch = {}
        for s in range(sessions):
            history[s] += [rng.randrange(3, 300) for _ in range(rng.randint(3, 9))]  # the user's turn
            batch[f"s{s}t{t}"] = list(history[s])
        got, hits = generate(engine, batch)
        for s in range(sessions):
            rid = f"s{s}t{t}"
            prompts.append(batch[rid])
            outputs.append(got[rid])
            cached.append(hits[rid])
            history[s] += got[rid]  # the assistant's answer is part of the next prompt
    return prompts, outputs, cached


def near_tie(model_dir: str, prompt: list[int], ours: list[int], ref: list[int]) -> bool:
    """The first differing position follows a top-2 logit margin below 1e-3 (reference model)."""
    i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1]) < 1e-3


def assert_same_greedy(model_dir, prompts, got, ref):
    for p, g, r in zip(prompts, got, ref):
        assert g == r or near_tie(model_dir, p, g, r), (p, g, r)


@pytest.mark.parametrize("blocks", [256, 24])  # 24: later turns evict earlier sessions' blocks
@pytest.mark.parametrize("kv", ["auto", "float16"])
def test_multiturn_cache_on_equals_off(tiny_llama_dir, blocks, kv):
    system = [random.Random(1).randrange(3, 300) for _ in range(37)]
    on = make_engine(tiny_llama_dir, True, blocks, kv=kv)
    off = make_engine(tiny_llama_dir, False, blocks, kv=kv)
    assert on.pool.layers[0]["k"].dtype == (torch.float16 if kv == "float16" else torch.float32)
    prompts, got, cached = conversation(on, 3, 3, system, seed=5)
    prompts_off, ref, cached_off = conversation(off, 3, 3, system, seed=5)
    assert_same_greedy(tiny_llama_dir, prompts, got, ref)
    assert set(cached_off) == {0}
    assert sum(cached[3:]) > 0  # later turns reuse the conversation so far
    assert all(c < len(p) for c, p in zip(cached, prompts))
    for engine in (on, off):
        engine.allocator.check_integrity()
        assert engine.allocator.num_used == 0 and engine.allocator.num_free == engine.pool.num_blocks
    assert on.allocator.num_cached > 0 and off.allocator.num_cached == 0
    if blocks == 24:
        assert on.allocator.num_evictions > 0
    else:
        assert on.allocator.num_hits == sum(cached)
        assert on.allocator.num_queries == sum(len(p) for p in prompts)
        # nothing evicted: a later turn reuses all the KV its session's last turn computed (the
        # last block's first tokens from its tail), i.e. all but that turn's last output token
        for i in range(3, len(prompts)):
            assert cached[i] == len(prompts[i - 3]) + len(got[i - 3]) - 1


@pytest.mark.parametrize("length", [20, 21, 23, 3])
def test_repeated_prompt_reports_all_but_the_last_block_cached(tiny_llama_dir, length):
    engine = make_engine(tiny_llama_dir, True)
    prompt = [7 + i % 200 for i in range(length)]
    first, c1 = generate(engine, {"a": prompt})
    second, c2 = generate(engine, {"b": prompt})
    assert c1["a"] == 0
    assert c2["b"] == (length - 1) // BS * BS  # whole blocks, and the last token is computed
    assert first["a"] == second["b"]


def test_a_cache_salt_shares_cached_blocks_only_with_requests_of_that_salt(tiny_llama_dir):
    """vLLM's cache_salt: a salted request reuses only what requests with the same salt left,
    its blocks and its tails (a later turn), and leaves nothing an unsalted or otherwise salted
    request can reuse; the outputs do not change."""
    engine = make_engine(tiny_llama_dir, True)
    prompt = [7 + i % 200 for i in range(22)]
    full = (len(prompt) - 1) // BS * BS
    runs = [("a1", "tenant-a", 0), ("b1", "tenant-b", 0), ("plain1", None, 0),
            ("a2", "tenant-a", full), ("plain2", None, full), ("b2", "tenant-b", full)]
    outputs = {}
    for rid, salt, expected in runs:
        got, cached = generate(engine, {rid: prompt}, cache_salt=salt)
        assert cached[rid] == expected, rid
        outputs[rid] = got[rid]
    assert len(set(map(tuple, outputs.values()))) == 1
    # a later turn of tenant a's conversation: all its KV (the last block's first tokens from
    # the tail a2 left) but the answer's last token, under its own salt only
    turn = prompt + outputs["a2"] + [31, 32, 33]
    _, cached = generate(engine, {"c": turn}, cache_salt="tenant-c")
    assert cached["c"] == 0
    _, cached = generate(engine, {"a3": turn}, cache_salt="tenant-a")
    assert cached["a3"] == len(prompt) + len(outputs["a2"]) - 1
    engine.allocator.check_integrity()
    assert engine.allocator.num_used == 0


def test_a_reset_forgets_every_cached_block_and_spares_the_running_requests(tiny_llama_dir):
    """POST /reset_prefix_cache's engine half: once the step that carries it is applied, no
    request reuses KV computed before it (on the device, in the host tier, or held by a running
    request at the time), and the request running through it gives the tokens it would have."""
    engine = make_engine(tiny_llama_dir, True, blocks=14, host_blocks=16)  # r evicts to the host tier
    done_prompt = [7 + i % 200 for i in range(30)]
    running_prompt = [11 + i % 150 for i in range(26)]
    reference, _ = generate(make_engine(tiny_llama_dir, False), {"r": running_prompt}, max_tokens=12)
    first, _ = generate(engine, {"done": done_prompt})
    engine.add_request("r", running_prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tokens = [o.token_id for o in engine.step()[1] + engine.step()[1] if o.token_id is not None]
    assert engine.scheduler.seqs["r"].num_computed > 0
    assert engine.allocator.num_cached > 0 and engine.allocator.host.num_cached > 0
    reset = engine.reset_prefix_cache()
    tokens += [o.token_id for o in engine.step()[1] if o.token_id is not None]
    assert reset.result(timeout=0) > 0
    assert engine.allocator.num_cached == engine.allocator.host.num_cached == 0
    tokens += [o.token_id for o in engine.run_until_done() if o.token_id is not None]
    assert tokens == reference["r"]
    engine.allocator.check_integrity()
    again, cached = generate(engine, {"done-again": done_prompt, "r-again": running_prompt})
    assert cached == {"done-again": 0, "r-again": 0}
    assert again["done-again"] == first["done"]
    _, cached = generate(engine, {"done-3": done_prompt})  # and the cache works on afterwards
    assert cached["done-3"] == (len(done_prompt) - 1) // BS * BS


def test_shared_prefix_in_one_step_and_abort_keep_the_books(tiny_llama_dir):
    """Requests sharing cached blocks, one aborted mid-way: the others finish, the shared
    blocks are held by the survivors (never freed under them), and all come back cached."""
    engine = make_engine(tiny_llama_dir, True)
    base = [9 + i for i in range(24)]
    generate(engine, {"warm": base})
    for i in range(4):
        engine.add_request(f"r{i}", base + [100 + i, 5, 6], SamplingParams(temperature=0, max_tokens=8,
                                                                           ignore_eos=True))
    engine.step()
    engine.step()
    shared = engine.scheduler.seqs["r0"].block_table[0]
    assert all(engine.scheduler.seqs[f"r{i}"].block_table[0] == shared for i in range(4))
    assert engine.allocator.refcount(shared) == 4
    engine.abort("r1")
    engine.step()
    assert engine.allocator.refcount(shared) == 3
    engine.allocator.check_integrity()
    engine.run_until_done()
    engine.allocator.check_integrity()
    assert engine.allocator.num_used == 0 and engine.allocator.is_cached(shared)


def test_no_prefix_cache_flag_reaches_the_workers_engine_config():
    from pdserve.cli import build_parser, engine_config
    from pdserve.launcher import engine_flags

    assert engine_config(build_parser().parse_args(["generate", "hi"])).prefix_cache is True
    assert engine_config(build_parser().parse_args(["generate", "hi", "--no-prefix-cache"])).prefix_cache is False
    serve = build_parser().parse_args(["serve", "--no-prefix-cache"])
    flags = engine_flags(serve)
    assert "--no-prefix-cache" in flags
    worker = build_parser().parse_args(["worker", "--role", "both", *flags])
    assert engine_config(worker).prefix_cache is False
    assert "--no-prefix-cache" not in engine_flags(build_parser().parse_args(["serve"]))


@pytest.mark.parametrize("device,kv", [
    ("cpu", "auto"),
    ("cpu", "float16"),  # the tier's copies take the pool's dtype
    pytest.param("cuda", "auto", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
])
def test_multiturn_with_hits_from_the_host_tier_equals_cache_off(tiny_llama_dir, device, kv):
    """A device pool too small to keep the conversations: their blocks are evicted to host
    memory and loaded back on the next turn; the tokens are those of the cache-off engine. On
    CUDA the tier's copies are asynchronous, on their own stream (kvcache/host.py)."""
    system = [random.Random(2).randrange(3, 300) for _ in range(37)]
    on = make_engine(tiny_llama_dir, True, 24, host_blocks=200, device=device, kv=kv)
    off = make_engine(tiny_llama_dir, False, 24, device=device, kv=kv)
    assert {t.dtype for t in on.allocator.host.tensors} == {on.pool.layers[0]["k"].dtype}
    assert (on.allocator.host.stream is not None) == (device == "cuda")
    prompts, got, cached = conversation(on, 3, 3, system, seed=7)
    _, ref, _ = conversation(off, 3, 3, system, seed=7)
    assert_same_greedy(tiny_llama_dir, prompts, got, ref)
    host = on.allocator.host
    assert on.allocator.num_evictions > 0 and host.num_saved > 0 and host.num_loaded > 0
    assert on.allocator.num_host_hits == host.num_loaded * BS
    assert sum(cached[3:]) > 0
    on.allocator.check_integrity()
    assert on.allocator.num_used == 0
