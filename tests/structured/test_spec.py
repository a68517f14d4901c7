"""OpenAI and vLLM request fields → GrammarSpec; malformed fields name themselves."""
from __future__ import annotations

import json

import pytest

from pdserve.structured.bitmask import new_bitmask, unpack
from pdserve.structured.spec import SpecError, from_response_format, from_vllm, tool_call_schema, tools_strict
from pdserve.worker_api import GrammarKind, GrammarSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "noop"}}]


def test_response_format_text_json_object_and_json_schema() -> None:
    assert from_response_format(None) is None and from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type":"object"}')
    spec = from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert spec.kind is GrammarKind.JSON_SCHEMA and json.loads(spec.value) == SCHEMA and spec.strict
    lax = from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    assert not lax.strict


def test_the_schema_keeps_the_clients_property_order() -> None:
    """The grammar writes properties in the schema's order, so the spec must not reorder them."""
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string"}}}
    for spec in (from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
                 from_vllm({"json": schema}, {}), from_vllm(None, {"guided_json": json.dumps(schema)})):
        assert list(json.loads(spec.value)["properties"]) == ["zeta", "alpha"]


@pytest.mark.parametrize("rf", [{"type": "xml"}, {"type": "json_schema"},
                                {"type": "json_schema", "json_schema": {"schema": [1]}}])
def test_malformed_response_format_names_response_format(rf) -> None:
    with pytest.raises(SpecError) as e:
        from_response_format(rf)
    assert e.value.param == "response_format"


def test_vllm_structured_outputs_and_guided_fields() -> None:
    assert from_vllm({"regex": "[ab]+"}, {}) == GrammarSpec(GrammarKind.REGEX, "[ab]+")
    assert from_vllm({"choice": ["yes", "no"]}, {}) == GrammarSpec(GrammarKind.CHOICE, '["yes", "no"]')
    assert from_vllm({"grammar": "start: \"x\""}, {}).kind is GrammarKind.GRAMMAR
    assert from_vllm({"json": json.dumps(SCHEMA)}, {}).value == json.dumps(SCHEMA, separators=(",", ":"))
    assert from_vllm(None, {"guided_choice": ["a"]}) == GrammarSpec(GrammarKind.CHOICE, '["a"]')
    assert from_vllm(None, {}) is None
    for bad, param in [({"regex": "a", "choice": ["b"]}, "structured_outputs"), ({}, "structured_outputs"),
                       ({"choice": []}, "structured_outputs.choice"), ({"json": "{"}, "structured_outputs.json")]:
        with pytest.raises(SpecError) as e:
            from_vllm(bad, {})
        assert e.value.param == param


def test_tool_call_schema_named_required_and_parallel() -> None:
    named = tool_call_schema(TOOLS, "get_weather", parallel=True)
    assert named["properties"]["name"] == {"const": "get_weather"}
    assert named["properties"]["arguments"] == {**TOOLS[0]["function"]["parameters"], "additionalProperties": False}
    one = tool_call_schema(TOOLS, None, parallel=False)
    assert [c["properties"]["name"]["const"] for c in one["anyOf"]] == ["get_weather", "noop"]
    many = tool_call_schema(TOOLS, None, parallel=True)
    assert many["type"] == "array" and many["minItems"] == 1 and many["items"] == one
    assert tools_strict(TOOLS, "get_weather") and not tools_strict(TOOLS, None)


def writable(grammars, tokenizer, schema: dict, text: str) -> bool:
    """Whether the grammar of `schema` lets the default model's tokenizer write `text`, then EOS."""
    matcher = grammars.backend.matcher(grammars.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))))
    mask = new_bitmask(1, tokenizer.vocab_size)
    for token in [*tokenizer.encode(text), tokenizer.eos_token_id]:
        matcher.fill_bitmask(mask, 0)
        if not unpack(mask, tokenizer.vocab_size)[0, token]:
            return False
        assert matcher.consume(token)
    return True


@pytest.mark.parametrize("parameters", [None, {}, {"type": "object", "properties": {}}])
def test_a_json_call_writes_only_the_listed_parameters_and_none_where_none_are_given(
        grammars, tokenizer, parameters) -> None:
    """OpenAI reads a function without `parameters` as one without parameters, and a schema that
    lists properties as taking those (the call syntaxes' grammars hold calls to the same)."""
    now = {"name": "now"} if parameters is None else {"name": "now", "parameters": parameters}
    tools = [{"type": "function", "function": now},
             {"type": "function", "function": {"name": "get_weather", "parameters": {
                 "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    schema = tool_call_schema(tools, None, parallel=False)
    assert writable(grammars, tokenizer, schema, '{"name":"now","arguments":{}}')
    assert not writable(grammars, tokenizer, schema, '{"name":"now","arguments":{"":1}}')
    assert writable(grammars, tokenizer, schema, '{"name":"get_weather","arguments":{"city":"Paris"}}')
    assert not writable(grammars, tokenizer, schema, '{"name":"get_weather","arguments":{"city":"Paris","days":2}}')
    open_ended = {"type": "object", "additionalProperties": {"type": "integer"}}  # says what others may be
    tools[1]["function"]["parameters"] = open_ended
    assert writable(grammars, tokenizer, tool_call_schema(tools, "get_weather", parallel=False),
                    '{"name":"get_weather","arguments":{"days":2}}')
