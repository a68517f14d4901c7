"""The fused path of a Llama with GGUF-block weights: every step (prompt chunks, new tokens over a
cached prefix, decode rows) runs the layers in one native call (and, on AVX-512 unless
$PDSERVE_INT16_ACTIVATIONS=0, the packed int16 projections), and generates the same greedy tokens
as the op-by-op path it replaces, alone, in a batch and over the prefix cache.

The op-by-op path is what runs when the three ops are bound to their references (as
`bench/offline.py --ab-op` does), so one engine serves both runs.
"""
from __future__ import annotations

import contextlib

import pytest

import pdserve_kernels as ops
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve_kernels import cpu_lib, dispatch

FUSED = ("attention_block", "fused_layers", "mlp_block", "qmatmul_packed")


@contextlib.contextmanager
def op_by_op(names: tuple[str, ...] = FUSED):
    chosen = {name: dispatch.OPS[name].impl for name in names}
    for name in names:
        dispatch.OPS[name].impl = dispatch.OPS[name].reference
    try:
        yield
    finally:
        for name, impl in chosen.items():
            dispatch.OPS[name].impl = impl


@pytest.fixture(scope="module", params=["fp32-activations", "int16-activations"])
def engine(tiny_llama_dir, request):
    with pytest.MonkeyPatch.context() as mp:  # read when the weights load
        mp.setenv("PDSERVE_INT16_ACTIVATIONS", "1" if request.param == "int16-activations" else "0")
        return LLMEngine(EngineConfig(model=tiny_llama_dir, quantization="int4", kernels="native", max_num_seqs=4))


def greedy(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    tokens: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        result = engine.step()
        for out in result[1] if isinstance(result, tuple) else result:
            if out.token_id is not None:
                tokens[out.request_id].append(out.token_id)
    return list(tokens.values())


def test_a_block_quantized_llama_runs_through_the_fused_blocks(engine, request):
    model = engine.model.model
    assert all(layer.can_fuse() for layer in model.layers)
    assert ops.is_native(ops.attention_block) and ops.is_native(ops.mlp_block)
    assert ops.is_native(ops.fused_layers)  # TP = 1: every layer of a step in one call
    packed = model.layers[0].mlp.gate_up_proj.packed
    asked = request.node.callspec.params["engine"] == "int16-activations"
    assert (packed is not None) == (asked and cpu_lib.packed_supported())  # AVX-512, not forced to AVX2


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_steps_generate_the_op_by_op_tokens(engine, batch):
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 7] for i in range(batch)]
    fused = greedy(engine, prompts, f"fused{batch}")
    with op_by_op():
        reference = greedy(engine, prompts, f"ref{batch}")
    assert fused == reference and all(len(t) == 12 for t in fused)


def test_new_tokens_over_a_cached_prefix_run_fused_and_give_the_op_by_op_tokens(engine, monkeypatch):
    """Later turns: new tokens over a prefix cached by the first turn (several rows a sequence:
    the extend attention inside the one fused call) give the op-by-op path's tokens over the same
    cached prefix; the step really ran fused, on the uncached rows only."""
    prefix = [(7 * i) % 200 + 3 for i in range(40)]  # 2 full blocks of 16 stay cached after turn 1
    greedy(engine, [prefix + [11, 12]], "turn1")
    later = [prefix + [13, 14, 15, 16, 17], prefix + [21, 22, 23]]
    rows: list[int] = []
    native = cpu_lib.fused_layers

    def counting(table, x, *args, **kwargs):
        rows.append(x.shape[0])
        return native(table, x, *args, **kwargs)

    monkeypatch.setattr(cpu_lib, "fused_layers", counting)
    fused = greedy(engine, later, "turn2")
    monkeypatch.setattr(cpu_lib, "fused_layers", native)
    assert rows[0] == (45 - 32) + (43 - 32)  # both prompts' uncached tokens in the first step
    with op_by_op():  # the same 32 cached tokens: these prompts' own blocks past them are not full
        reference = greedy(engine, later, "turn2-ref")
    assert fused == reference and all(len(t) == 12 for t in fused)


def prompt_logprobs(engine: LLMEngine, prompt: list[int], tag: str) -> list[tuple[float, dict]]:
    """Each prompt token's logprob and top 3 (after the first), from one step over the prompt."""
    engine.add_request(tag, prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))
    got = None
    while engine.has_work():
        result = engine.step()
        for out in result[1] if isinstance(result, tuple) else result:
            if out.prompt_logprobs is not None:
                got = [(e.logprob, e.top) for e in out.prompt_logprobs if e is not None]
    return got


def test_a_prompt_scores_the_same_fused_and_op_by_op_bit_for_bit(engine):
    """The fused blocks' SwiGLU and RoPE are torch's arithmetic (csrc/cpu/layer_ops_avx2.cpp) and
    everything else is the same kernel either way, so a prompt's logprobs do not change in the
    last bit when its layers run in one call: `echo` and `prompt_logprobs` keep the bound they
    have against transformers (tests/frontend/test_echo_logprobs_e2e.py). (The projections stay
    native both ways: the packed int16 product's torch reference sums in another order.)"""
    prompt = [(11 * i) % 250 + 3 for i in range(37)]
    fused = prompt_logprobs(engine, prompt, "scored-fused")
    with op_by_op(("attention_block", "fused_layers", "mlp_block")):
        reference = prompt_logprobs(engine, prompt + [0], "scored-ref")[:-1]  # + 1 token: no cache hit
    assert len(fused) == 36 and fused == reference

