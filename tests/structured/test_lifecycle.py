"""Matcher lifetime in the engine: a preempted constrained request is recomputed and resumes
its grammar exactly; so does one resumed from its tokens so far on another engine (the router's
retry after a worker failed it); aborting many constrained requests releases every matcher and
block."""
from __future__ import annotations

import dataclasses
import json

import jsonschema

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.structured import GrammarKind, GrammarSpec
from pdserve.tokenizer import Tokenizer

from .test_json_schemas import PROMPT, run

SCHEMA = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 6},
    "n": {"type": "integer", "minimum": 0, "maximum": 99999}}, "required": ["tags", "n"], "additionalProperties": False}
SPEC = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
BLOCK = 16
PER_BLOCK = BLOCK * 2 * 2 * 4 * 8 * 4  # json_llama: 2 layers × (K, V) × 4 KV heads × 8 dims × 4 bytes


def params(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured=SPEC)


def test_preempted_constrained_requests_resume_their_grammar_exactly(json_llama_dir) -> None:
    ids = Tokenizer(json_llama_dir).encode(PROMPT)
    roomy = LLMEngine(EngineConfig(model=json_llama_dir, block_size=BLOCK))
    alone = {f"r{i}": run(roomy, {f"r{i}": (ids, params(i))})[f"r{i}"] for i in range(8)}
    small = LLMEngine(EngineConfig(model=json_llama_dir, block_size=BLOCK, kv_cache_memory=14 * PER_BLOCK,
                                   max_num_seqs=8, prefix_cache=False))
    together = run(small, {f"r{i}": (ids, params(i)) for i in range(8)})
    assert small.scheduler.num_preemptions > 0, "the small pool should have forced preemption"
    assert together == alone  # seeded: the same tokens, so the replayed matchers allowed the same
    tok = Tokenizer(json_llama_dir)
    for tokens, reason in together.values():
        assert reason == "stop"
        jsonschema.validate(json.loads(tok.decode(tokens, skip_special_tokens=True)), SCHEMA)
    assert small.grammars.live == 0 and small.allocator.num_free == small.pool.num_blocks


def test_a_constrained_choice_resumed_from_its_tokens_elsewhere_reads_them_into_its_grammar(json_llama_dir) -> None:
    """The router's retry after a worker failed a choice k tokens in: another engine gets the
    prompt with those tokens appended, marked as output. Its grammar must start from them (else
    it would ask for a new document's opening brace) and its seed must draw on from there."""
    ids = Tokenizer(json_llama_dir).encode(PROMPT)
    first = LLMEngine(EngineConfig(model=json_llama_dir, block_size=BLOCK))
    full, reason = run(first, {"r": (ids, params(3))})["r"]
    assert reason == "stop" and len(full) > 12
    other = LLMEngine(EngineConfig(model=json_llama_dir, block_size=BLOCK))
    for k in (1, 5, 12):
        again = dataclasses.replace(params(3), max_tokens=params(3).max_tokens - k, resumed_tokens=k)
        rest, reason = run(other, {f"r~{k}": (ids + full[:k], again)})[f"r~{k}"]
        assert (full[:k] + rest, reason) == (full, "stop"), k
    assert other.grammars.live == 0 and other.allocator.num_free == other.pool.num_blocks


def test_aborting_many_constrained_requests_releases_every_matcher(json_llama_dir) -> None:
    ids = Tokenizer(json_llama_dir).encode(PROMPT)
    engine = LLMEngine(EngineConfig(model=json_llama_dir, block_size=BLOCK, max_num_seqs=64))
    for i in range(100):
        engine.add_request(f"a{i}", ids * (1 + i % 3), params(i))
    while engine.grammars.live < 50:  # matchers are started by the sampler, as requests decode
        engine.step()
    for i in range(100):
        engine.abort(f"a{i}")
        engine.abort(f"a{i}")  # twice: idempotent
    reasons = {o.request_id: str(o.finish_reason) for o in engine.run_until_done() if o.finish_reason}
    assert engine.grammars.live == 0
    assert engine.allocator.num_free == engine.pool.num_blocks
    assert "abort" in reasons.values() and set(reasons.values()) <= {"abort", "stop"}
    # and the engine still serves
    out = run(engine, {"after": (ids, params(1))})["after"]
    assert out[1] == "stop" and engine.grammars.live == 0
