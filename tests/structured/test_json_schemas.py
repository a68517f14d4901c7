"""Random JSON Schemas through the engine (a tiny random Llama with the default model's
vocabulary): every document, greedy and sampled at temperature 1, completes and validates
with `jsonschema`; an unconstrained request in the same batch is untouched."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.structured import GrammarKind, GrammarSpec
from pdserve.tokenizer import Tokenizer

from .strategies import OBJECT_SCHEMAS

PROMPT = "<|im_start|>user\nAnswer in JSON.<|im_end|>\n<|im_start|>assistant\n"
FREE = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def engine(json_llama_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=json_llama_dir))


@pytest.fixture(scope="module")
def tok(json_llama_dir: str) -> Tokenizer:
    return Tokenizer(json_llama_dir)  # loaded once: a load costs more than a whole example


@pytest.fixture(scope="module")
def prompt(tok: Tokenizer) -> list[int]:
    return tok.encode(PROMPT)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str]]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons: dict[str, str] = {}
    for o in engine.run_until_done():
        if o.token_id is not None:
            tokens[o.request_id].append(o.token_id)
        if o.finish_reason is not None:
            reasons[o.request_id] = str(o.finish_reason)
    return {rid: (tokens[rid], reasons[rid]) for rid in requests}


def document(tok: Tokenizer, tokens: list[int]) -> object:
    return json.loads(tok.decode(tokens, skip_special_tokens=True))


@pytest.fixture(scope="module")
def free_alone(engine: LLMEngine, prompt: list[int]) -> list[int]:
    return run(engine, {"free": (prompt, FREE)})["free"][0]


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schema=OBJECT_SCHEMAS)
def test_every_document_validates_greedy_and_at_temperature_1(engine, tok, prompt, free_alone, schema) -> None:
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    out = run(engine, {
        "greedy": (prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured=spec)),
        "t1": (prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, structured=spec)),
        "t1b": (prompt, SamplingParams(temperature=1.0, seed=8, max_tokens=MAX_TOKENS, structured=spec)),
        "free": (prompt, FREE),
    })
    for rid in ("greedy", "t1", "t1b"):
        tokens, reason = out[rid]
        assert reason == "stop", (rid, schema, tok.decode(tokens))
        jsonschema.validate(document(tok, tokens), schema)
    assert out["free"][0] == free_alone
    assert engine.grammars.live == 0
    assert engine.allocator.num_free == engine.pool.num_blocks
