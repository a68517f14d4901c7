"""Constrained decoding across processes: PD with TP=2 on both sides gives the tokens of one
colocated TP=1 engine, for random schemas (the prefill worker samples the first token under
the grammar, the decode worker's matcher resumes from it; only rank 0 of each holds
matchers); a worker refuses a bad spec with a 400; a mass abort of 100 constrained streams
releases every matcher and block."""
from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings

from pdserve import worker_api as api
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.structured import GrammarKind, GrammarSpec
from pdserve.tokenizer import Tokenizer
from tests.worker.conftest import PDClient, WorkerProc, pool_full, ready, start_worker, stop_all, wait_for

from .strategies import OBJECT_SCHEMAS
from .test_json_schemas import PROMPT, run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

FLAGS = ("--tp", "2", "--check-divergence", "2", "--max-num-seqs", "64")
ORDER = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                          "b": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 4}},
         "required": ["a", "b"], "additionalProperties": False}


_IDS = itertools.count()  # request ids are never reused on a worker


def spec(schema: dict) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))


def prompts(model_dir: str) -> list[list[int]]:
    ids = Tokenizer(model_dir).encode(PROMPT)
    return [ids, ids[:5] + ids, ids * 2]


def live_matchers(w: WorkerProc) -> float:
    text = w.get("/metrics").text
    return float(re.search(r"^pdserve:grammar_matchers_live\{[^}]*\} (\S+)$", text, re.M).group(1))


@pytest.fixture(scope="module")
def reference(json_llama_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=json_llama_dir))


@pytest.fixture(scope="module")
def pd_tp2(json_llama_dir: str) -> Iterator[tuple[WorkerProc, WorkerProc]]:
    prefill, decode = ready(start_worker("prefill", json_llama_dir, *FLAGS, wait=False),
                            start_worker("decode", json_llama_dir, *FLAGS, wait=False))
    yield prefill, decode
    stop_all(prefill, decode)


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=OBJECT_SCHEMAS)
def test_pd_tp2_equals_colocated_tp1(json_llama_dir, reference, pd_tp2, schema) -> None:
    ps = prompts(json_llama_dir)
    params = {"temperature": 0, "max_tokens": 300, "structured": spec(schema)}
    ref = run(reference, {f"r{i}": (p, SamplingParams(**params)) for i, p in enumerate(ps)})

    async def go() -> list[tuple[list[int], str, str | None]]:
        c = PDClient(*pd_tp2)
        return await asyncio.gather(*(c.generate(f"g{next(_IDS)}", p, params)
                                      for i, p in enumerate(ps)))

    got = asyncio.run(asyncio.wait_for(go(), 300))
    tok = Tokenizer(json_llama_dir)
    for i, (tokens, reason, err) in enumerate(got):
        assert (tokens, reason, err) == (*ref[f"r{i}"], None), (i, schema)
        jsonschema.validate(json.loads(tok.decode(tokens, skip_special_tokens=True)), schema)


def test_a_worker_refuses_a_bad_spec(json_llama_dir, pd_tp2) -> None:
    prefill, decode = pd_tp2
    bad = api.GenerateRequest(request_id="bad", prompt_ids=prompts(json_llama_dir)[0], params=api.SamplingParams(
        structured=GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "foo"}')),
        prefill_url=prefill.url, prefill_worker_id=prefill.worker_id)
    r = httpx.post(decode.url + "/generate", json=bad.wire(), timeout=30)
    assert r.status_code == 400 and "Invalid type: foo" in r.json()["error"]["message"]


def test_a_mass_abort_of_constrained_streams_releases_every_matcher(json_llama_dir, pd_tp2) -> None:
    prefill, decode = pd_tp2
    ps = prompts(json_llama_dir)
    params = {"temperature": 0, "max_tokens": 400, "structured": spec(ORDER)}

    async def mass_abort() -> None:
        c = PDClient(prefill, decode)
        tasks = [asyncio.create_task(c.generate(f"m{i}", ps[i % len(ps)], params)) for i in range(100)]
        while (await c.http.get(decode.url + "/load")).json()["running"] < 8:
            await asyncio.sleep(0.02)
        for t in tasks:  # the client side of a mass abort: every stream goes away at once
            t.cancel()
        await asyncio.gather(*(c.abort(f"m{i}") for i in range(100)))
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(asyncio.wait_for(mass_abort(), 300))
    for w in (prefill, decode):
        assert w.get("/health").status_code == 200, w.get("/health").text
    wait_for(lambda: pool_full(prefill) and pool_full(decode), 60, "pools full")
    wait_for(lambda: live_matchers(prefill) == 0 and live_matchers(decode) == 0, 30, "matchers released")
