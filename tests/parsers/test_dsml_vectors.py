"""Spec Part 3: the 28 vectors, with the real V3.2 and V4 tokenizers, under every chunking of
§2.10 and a non-canonical tokenization (one character per token, marker ids kept)."""
from __future__ import annotations

import random

import pytest

from pdserve.parsers import aggregate

from tests.parsers.harness import char_tokenization, normalized, run, splits
from tests.parsers.realtok import Model, load_model
from tests.parsers.vectors import VECTORS, Vector

MODELS = {"v32": "deepseek-v3.2", "v4": "deepseek-v4"}
CASES = [pytest.param(v, key, id=f"{v.name}-{key}") for v in VECTORS for key in MODELS]


def text_for(vector: Vector, key: str) -> str:
    """The vector in the given model's own block name (V3.2 function_calls, V4 tool_calls)."""
    if key == vector.model:
        return vector.text
    src, dst = ("function_calls", "tool_calls") if key == "v4" else ("tool_calls", "function_calls")
    return vector.text.replace(src, dst)


def outcome(events: list) -> tuple:
    agg = aggregate(events)
    calls = tuple((c.name, c.arguments, c.complete) for c in agg.tool_calls)
    return agg.reasoning, agg.content, calls, agg.finish_reason, tuple(d.code for d in agg.diagnostics), agg.failed


def expected(vector: Vector) -> tuple:
    return vector.reasoning, vector.content, vector.calls, vector.finish, vector.diags, vector.failed


@pytest.mark.parametrize(("vector", "key"), CASES)
def test_vector_gives_the_expected_message(vector: Vector, key: str) -> None:
    model = load_model(MODELS[key])
    ids = model.encode(text_for(vector, key))
    assert outcome(run(model, ids, vector.options, length=vector.length)) == expected(vector)
    if key == vector.model:
        assert all(f in ids for f in vector.fused), "the canonical tokenization fuses the opener as the spec says"


@pytest.mark.parametrize(("vector", "key"), CASES)
def test_vector_events_do_not_depend_on_chunking(vector: Vector, key: str) -> None:
    model = load_model(MODELS[key])
    ids = model.encode(text_for(vector, key))
    reference = run(model, ids, vector.options, length=vector.length)
    rng = random.Random(vector.name)
    for cuts in splits(len(ids), rng):
        assert run(model, ids, vector.options, cuts, vector.length) == reference, cuts


@pytest.mark.parametrize(("vector", "key"), CASES)
def test_vector_result_does_not_depend_on_tokenization(vector: Vector, key: str) -> None:
    model: Model = load_model(MODELS[key])
    text = text_for(vector, key)
    canonical = normalized(run(model, model.encode(text), vector.options, length=vector.length))
    ids = char_tokenization(model, text)
    assert len(ids) > len(model.encode(text))
    rng = random.Random(vector.name)
    for cuts in splits(len(ids), rng, two_way_max=48):
        events = run(model, ids, vector.options, cuts, vector.length)
        assert normalized(events) == canonical, cuts
        assert outcome(events) == expected(vector)
