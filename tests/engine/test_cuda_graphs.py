"""Steps as CUDA graphs (engine/cuda_graphs.py): who may use them, the flag that turns them off,
the rotary table they need, the prompt graphs' buckets, and on a GPU the same tokens as the eager
engine (decode graphs; prompt graphs, piecewise)."""
from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import cuda_graphs
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.layers.rotary import RotaryEmbedding
from pdserve_kernels import cuda_lib

needs_cuda = pytest.mark.skipif(not cuda_lib.available(), reason="needs a CUDA device and the kernels (make kernels)")


def test_graphs_are_for_cuda_llama_models_at_tp1(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, threads=1))
    assert engine.runner.graphs is None and engine.runner.prompt_graphs is None
    assert cuda_graphs.unusable(engine.model, "cpu", 1, torch.float32) == "not a CUDA device"
    assert cuda_graphs.unusable(engine.model, "cuda", 2, torch.bfloat16) == \
        "tensor parallelism (the collectives run outside the GPU's streams)"


def test_graphs_are_not_for_other_families(tmp_path):
    from tests.tiny_models import make_deepseek

    engine = LLMEngine(EngineConfig(model=make_deepseek(tmp_path, "deepseek-v3"), threads=1))
    assert cuda_graphs.unusable(engine.model, "cuda", 1, torch.bfloat16) == \
        f"{type(engine.model).__name__} is not in the Llama family"


def test_no_cuda_graphs_reaches_the_workers_engine_config():
    from pdserve.cli import build_parser, engine_config
    from pdserve.launcher import engine_flags

    assert engine_config(build_parser().parse_args(["generate", "hi"])).cuda_graphs is True
    serve = build_parser().parse_args(["serve", "--no-cuda-graphs"])
    flags = engine_flags(serve)
    assert "--no-cuda-graphs" in flags
    assert engine_config(build_parser().parse_args(["worker", "--role", "both", *flags])).cuda_graphs is False
    assert "--no-cuda-graphs" not in engine_flags(build_parser().parse_args(["serve"]))


def test_a_covered_rotary_table_gives_the_grown_tables_values():
    grown, covered = RotaryEmbedding(64, 10000.0), RotaryEmbedding(64, 10000.0)
    covered.cover(700, "cpu")
    for positions in (torch.tensor([0, 5, 511]), torch.tensor([699, 3]), torch.arange(40)):
        for a, b in zip(grown.cos_sin(positions), covered.cos_sin(positions)):
            assert torch.equal(a, b)
    assert covered._table[0].shape[0] == 700  # never regrown past what it covers


def test_prompt_buckets_double_from_16_up_to_the_step_budget():
    assert cuda_graphs.prompt_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert cuda_graphs.prompt_buckets(600) == [16, 32, 64, 128, 256, 512, 600]
    assert cuda_graphs.prompt_buckets(16) == [16]
    assert cuda_graphs.prompt_buckets(10) == [10]


@pytest.fixture(scope="module")
def head64_llama_dir(tmp_path_factory) -> str:
    """A 2-layer random Llama whose head size the CUDA decode kernel takes (64)."""
    import transformers

    path = tmp_path_factory.mktemp("llama-d64")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                   eos_token_id=2, bos_token_id=1)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return str(path)


def _tokens(engine: LLMEngine, work: list[tuple[list[int], SamplingParams]], tag: str) -> dict[str, list[int]]:
    for i, (prompt, params) in enumerate(work):
        engine.add_request(f"{tag}{i}", prompt, params)
    out: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(work))}
    for o in engine.run_until_done():
        assert o.finish_reason != "error", o.error
        if o.token_id is not None:
            out[o.request_id].append(o.token_id)
    return out


@needs_cuda
def test_decode_graphs_give_the_eager_engines_tokens(head64_llama_dir):
    # a 64-token context: the graphs' split count (for the longest context) is then the eager
    # steps' own, so both run the same kernels in the same order and the tokens must be equal
    cfg = dict(model=head64_llama_dir, device="cuda", kernels="native", max_model_len=64, max_num_seqs=8,
               kv_cache_memory=8 << 20)
    eager = LLMEngine(EngineConfig(**cfg, cuda_graphs=False))
    graphs = LLMEngine(EngineConfig(**cfg))
    overlapped = LLMEngine(EngineConfig(**cfg, overlap=True))
    assert eager.runner.graphs is None and graphs.runner.graphs is not None
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    rounds = [[([5, 17, 99, 4, 8], greedy), (list(range(30, 39)), greedy), ([7] * 13, greedy)],
              [([11, 12], greedy), ([200, 3, 3, 8], greedy), (list(range(60, 80)), greedy), ([42] * 6, greedy),
               ([9, 8, 7], SamplingParams(temperature=1.0, seed=4, max_tokens=20, ignore_eos=True))]]
    for r, work in enumerate(rounds):
        want = _tokens(eager, work, f"r{r}-")
        assert all(len(t) == 20 for t in want.values())
        assert _tokens(graphs, work, f"r{r}-") == want
        assert _tokens(overlapped, work, f"r{r}-") == want
    # the first decode step of each batch size runs eagerly and captures; the other 18 replay
    assert graphs.runner.graphs.disabled is None
    assert {n: g.replays for n, g in graphs.runner.graphs.graphs.items()} == {3: 18, 5: 18}
    assert overlapped.runner.graphs.disabled is None
    assert sorted(overlapped.runner.graphs.graphs) == [3, 5]
    assert all(g.replays > 0 for g in overlapped.runner.graphs.graphs.values())
    overlapped.close()


def _conversations(engine: LLMEngine) -> dict[str, list[int]]:
    """Three sessions, three turns: each turn resends the conversation (so it is mostly cached)
    and is added two steps after the previous session's, while that one decodes (mixed steps)."""
    rng = random.Random(3)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    history = [[rng.randrange(3, 300) for _ in range(rng.randint(20, 90))] for _ in range(3)]
    out: dict[str, list[int]] = {}

    def step() -> None:
        for o in engine.step()[1]:
            assert o.finish_reason != "error", o.error
            if o.token_id is not None:
                out[o.request_id].append(o.token_id)

    for turn in range(3):
        for s in range(3):
            history[s] += [rng.randrange(3, 300) for _ in range(rng.randint(5, 40))]  # the user's turn
            out[f"s{s}t{turn}"] = []
            engine.add_request(f"s{s}t{turn}", list(history[s]), greedy)
            step()
            step()
        while engine.has_work():
            step()
        for s in range(3):
            history[s] += out[f"s{s}t{turn}"]
    return out


@needs_cuda
def test_prompt_graphs_give_the_eager_engines_tokens(head64_llama_dir):
    # prompts of 25-130 tokens in chunks of at most 64 (buckets 16, 32, 64), later turns over a
    # cached prefix, prompts beside decoding rows; both engines replay the same decode graphs,
    # so the prompt steps are the only difference
    cfg = EngineConfig(model=head64_llama_dir, device="cuda", kernels="native", max_model_len=256, max_num_seqs=8,
                       max_num_batched_tokens=64, kv_cache_memory=8 << 20)
    eager, graphs = LLMEngine(cfg), LLMEngine(cfg)
    eager.runner.prompt_graphs = None
    assert graphs.runner.prompt_graphs.buckets == [16, 32, 64]
    want = _conversations(eager)
    assert all(len(t) == 12 for t in want.values())
    assert _conversations(graphs) == want
    prompts = graphs.runner.prompt_graphs
    assert prompts.disabled is None
    assert sum(g.replays for g in prompts.graphs.values()) > 0
    assert all(len(g.calls) == 2 for g in prompts.graphs.values())  # a segment per attention layer
