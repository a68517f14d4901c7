"""The scripted model emits its script exactly, then EOS, whatever the prompt and batching."""
from __future__ import annotations

import json

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams


def make_scripted(path, script: list[int], vocab: int = 500, eos: int = 2) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["ScriptedForCausalLM"],
                                                  "vocab_size": vocab, "eos_token_id": eos,
                                                  "pdserve_script": script}))
    return str(path)


def test_script_then_eos_for_any_prompt_and_chunking(tmp_path):
    script = [10, 11, 11, 400, 10, 3]
    engine = LLMEngine(EngineConfig(model=make_scripted(tmp_path / "m", script), block_size=4,
                                    max_num_batched_tokens=5))
    prompts = [[7, 8, 9], [10, 11], list(range(20, 60)), [3] * 13]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20))
    out = {f"r{i}": [] for i in range(len(prompts))}
    reasons = {}
    for o in engine.run_until_done():
        if o.token_id is not None:
            out[o.request_id].append(o.token_id)
        if o.finish_reason:
            reasons[o.request_id] = o.finish_reason
    for i in range(len(prompts)):
        assert out[f"r{i}"] == script + [2]
        assert reasons[f"r{i}"] == "stop"
    assert engine.allocator.num_free == engine.pool.num_blocks


def test_max_tokens_cuts_the_script(tmp_path):
    engine = LLMEngine(EngineConfig(model=make_scripted(tmp_path / "m", [5, 6, 7, 8])))
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
    tokens = [o.token_id for o in engine.run_until_done() if o.token_id is not None]
    assert tokens == [5, 6]
