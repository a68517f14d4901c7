"""The other direction of the grammar: every document valid under a random schema (keys in the
schema's order) is accepted whole, token by token, through the default model's tokenizer — the
grammar forbids nothing the schema allows."""
from __future__ import annotations

import json

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.structured import GrammarKind, GrammarSpec
from pdserve.structured.factory import grammars_for_tokenizer

from .strategies import OBJECT_SCHEMAS, documents


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_valid_document_is_accepted(tokenizer, data) -> None:
    schema = data.draw(OBJECT_SCHEMAS)
    doc = data.draw(documents(schema))
    jsonschema.validate(doc, schema)  # the generator's own check
    grammars = _grammars(tokenizer)
    state = grammars.start(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema)))
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    state.sync(tokenizer.encode(text))
    assert state.matcher.error is None and state.matcher.accepting, (schema, text)
    state.release()


_CACHE: dict = {}


def _grammars(tokenizer):
    """One cache for the whole test (its tokenizer table takes ~0.3 s to build)."""
    if tokenizer not in _CACHE:
        _CACHE[tokenizer] = grammars_for_tokenizer(tokenizer)
    return _CACHE[tokenizer]
