"""The fused decode path of a Llama with GGUF-block weights: a decode step runs two native calls
per layer (and, on AVX-512 unless $PDSERVE_INT16_ACTIVATIONS=0, the packed int16 projections), and
generates the same greedy tokens as the op-by-op path it replaces, alone and in a batch.

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

FUSED = ("decode_attention_block", "decode_layers", "decode_mlp_block", "qmatmul_packed")


@contextlib.contextmanager
def op_by_op():
    chosen = {name: dispatch.OPS[name].impl for name in FUSED}
    for name in FUSED:
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


def test_a_block_quantized_llama_decodes_through_the_fused_blocks(engine, request):
    model = engine.model.model
    assert all(layer.can_fuse_decode() for layer in model.layers)
    assert ops.is_native(ops.decode_attention_block) and ops.is_native(ops.decode_mlp_block)
    assert ops.is_native(ops.decode_layers)  # TP = 1: every layer of a decode step in one call
    packed = model.layers[0].mlp.gate_up_proj.packed
    asked = request.node.callspec.params["engine"] == "int16-activations"
    assert (packed is not None) == (asked and cpu_lib.packed_supported())  # AVX-512, not forced to AVX2


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_decode_generates_the_op_by_op_tokens(engine, batch):
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 7] for i in range(batch)]
    fused = greedy(engine, prompts, f"fused{batch}")
    with op_by_op():
        reference = greedy(engine, prompts, f"ref{batch}")
    assert fused == reference and all(len(t) == 12 for t in fused)
