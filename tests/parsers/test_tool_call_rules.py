"""The rules every tool-call grammar shares (docs/tool-calls.md), checked family by family with
the real tokenizers, every chunking and a one-character tokenization (tests/parsers/cases.py).

Peer notes (cases from vLLM's tests/tool_parsers and SGLang's function-call tests, in our words):
* a Hermes call whose JSON body is complete but lacks `</tool_call>` is returned (as vLLM does);
  pdserve also returns GLM, DSML and DeepSeek V3 calls whose arguments were complete when the
  output ended, and reports any other unfinished call instead of dropping it.
* vLLM converts a DSML or GLM value to the schema's type more loosely ("True" → true, "3.0" → 3);
  pdserve converts only when nothing is lost (the text is exactly the JSON of that type).
* vLLM keeps the text around calls byte for byte; pdserve drops the separator newlines in front
  of a call and keeps one separator where text resumes after it.
"""
from __future__ import annotations

import pytest

from pdserve.parsers import ParserOptions, ParamSchema, tool_schemas
from pdserve.parsers.typed import convert

from tests.parsers.cases import check
from tests.parsers.realtok import load_model
from tests.parsers.vectors import D, block, invoke, param

DS_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
OBS = "<|observation|>"
IM_END = "<|im_end|>"
B31, E31 = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CB, CE = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "o": {"type": "object"},
    "a": {"type": "array"}, "s": {"type": "string"}, "ns": {"type": ["string", "null"]},
    "any": {"description": "untyped"}}}}},
         {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {
             "arguments": {"type": "string"}}}}}]
TYPED = ParserOptions(schemas=tool_schemas(TOOLS))
EMIT = ParserOptions()
MODELS = {"dsml": "deepseek-v3.2", "glm": "glm-4.7-flash", "hermes": "qwen-3", "v31": "deepseek-v3.1",
          "v3": "deepseek-v3"}


def glm_call(name: str, **values: str) -> str:
    return f"<tool_call>{name}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>"
                                           for k, v in values.items()) + "</tool_call>"


def outcome(family: str, name: str, text: str, options: ParserOptions = EMIT, length: bool = False) -> tuple:
    return check(load_model(MODELS[family]), name, text, options, length)


# ---- §2 a call cut by the end of the output -------------------------------------------------------

CITY = '{"city": "Beijing"}'
CUT_COMPLETE = [  # the arguments were complete: the call is returned
    ("glm", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value>" + OBS),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Beijing"}}\n' + IM_END),
    ("dsml", f"\n\n<{D}function_calls>\n<{D}invoke name=\"get_weather\">\n" + param("city", "Beijing") + DS_EOS),
    ("v31", B31 + CB + "get_weather" + SEP + CITY + DS_EOS),
    ("v3", B31 + CB + "function" + SEP + "get_weather\n```json\n" + CITY + "\n```" + DS_EOS),
]


@pytest.mark.parametrize(("family", "text"), CUT_COMPLETE, ids=[c[0] for c in CUT_COMPLETE])
def test_a_call_with_complete_arguments_cut_by_eos_is_returned(family: str, text: str) -> None:
    assert outcome(family, "cut-complete", text) == (
        "", "", [("get_weather", CITY, True)], [], "tool_calls", ["call_closed_at_end"])


CUT_INCOMPLETE = [  # (family, text, what the model wrote of the call)
    ("glm", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Beij" + OBS, '{"city": "Beij'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Beij' + IM_END,
     '{"name": "get_weather", "arguments": {"city": "Beij'),
    ("dsml", f"\n\n<{D}function_calls>\n<{D}invoke name=\"get_weather\">\n<{D}parameter name=\"city\" "
     'string="true">Beij' + DS_EOS, '{"city": "Beij'),
    ("v31", B31 + CB + "get_weather" + SEP + '{"city": "Beij' + DS_EOS, '{"city": "Beij'),
    ("v3", B31 + CB + "function" + SEP + "get_weather\n```json\n{\"city\": \"Beij" + DS_EOS, '{"city": "Beij'),
]


@pytest.mark.parametrize(("family", "text", "written"), CUT_INCOMPLETE, ids=[c[0] for c in CUT_INCOMPLETE])
def test_an_incomplete_call_cut_by_eos_is_reported_not_returned(family: str, text: str, written: str) -> None:
    reasoning, content, calls, invalid, finish, diags = outcome(family, "cut-incomplete", "Checking." + text)
    assert (reasoning, content, calls, finish) == ("", "Checking.", [], "stop")
    assert invalid == [("get_weather", written, "ended_inside_block")]
    assert diags == ["ended_inside_block"]


@pytest.mark.parametrize(("family", "text", "written"), CUT_INCOMPLETE[:1] + CUT_INCOMPLETE[2:],
                         ids=[c[0] for c in CUT_INCOMPLETE[:1] + CUT_INCOMPLETE[2:]])
def test_an_incomplete_call_cut_by_the_token_limit_is_returned_incomplete(family: str, text: str,
                                                                          written: str) -> None:
    text = text.removesuffix(OBS).removesuffix(DS_EOS)
    assert outcome(family, "cut-length", text, length=True) == (
        "", "", [("get_weather", written, False)], [], "length", ["ended_inside_block"])


def test_a_hermes_call_cut_by_the_token_limit_is_reported() -> None:
    """Hermes calls are atomic (the name comes inside the JSON), so nothing of it was sent."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Beij'
    assert outcome("hermes", "hermes-length", text, length=True) == (
        "", "", [], [("get_weather", text.removeprefix("<tool_call>\n"), "ended_inside_block")], "length",
        ["ended_inside_block"])


INVALID = [
    ("hermes", 'ok\n<tool_call>\n{"name": "f", "arguments": "hello"}\n</tool_call>' + IM_END,
     ("f", '{"name": "f", "arguments": "hello"}', "invalid_call"), ["invalid_call"]),
    ("v31", "ok" + B31 + CB + "f" + SEP + "hello" + CE + E31 + DS_EOS, ("f", "hello", "invalid_call"),
     ["invalid_call"]),
    ("dsml", f"ok\n\n<{D}function_calls>\n<{D}invoke name=\"f\">\n{{\"a\": hello}}\n</{D}invoke>\n"
     f"</{D}function_calls>" + DS_EOS, ("f", '{"a": hello}', "invalid_json_body"), ["invalid_json_body"]),
]


@pytest.mark.parametrize(("family", "text", "report", "diags"), INVALID, ids=[c[0] for c in INVALID])
def test_an_invalid_call_is_reported_and_its_markup_stays_out_of_content(family: str, text: str, report: tuple,
                                                                         diags: list) -> None:
    assert outcome(family, "invalid", text) == ("", "ok", [], [report], "stop", diags)


# ---- §3 text around calls ----------------------------------------------------------------------------

GLM_ISSUE = ("I'll get the weather info.\n\n" + glm_call("get_weather", city="Beijing")
             + "\n\nMeanwhile, here is a tip." + OBS)
AROUND = [
    ("glm", GLM_ISSUE, "I'll get the weather info.\n\nMeanwhile, here is a tip."),
    ("glm", "A." + glm_call("f") + "B." + OBS, "A.B."),                  # no white space: none added
    ("glm", "A.\n" + glm_call("f") + "B." + OBS, "A.\nB."),              # the one before is kept
    ("glm", "A." + glm_call("f") + " \n\n\n B." + OBS, "A.\n\nB."),      # a run becomes one separator
    ("glm", "A.\n\n" + glm_call("f") + "\n\n" + OBS, "A."),              # trailing white space dropped
    ("glm", glm_call("f") + "\n\nB." + OBS, "B."),                       # nothing before: nothing kept
    ("hermes", 'A.\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\nB.' + IM_END, "A.\n\nB."),
    ("hermes", 'A.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n'
     '{"name": "f", "arguments": {}}\n</tool_call>\nB.' + IM_END, "A.\nB."),
    ("dsml", "A.\n\n" + block(invoke("f")) + "\n\nB." + DS_EOS, "A.\n\nB."),
    ("v31", "A." + B31 + CB + "f" + SEP + "{}" + CE + E31 + " B." + DS_EOS, "A. B."),
]


@pytest.mark.parametrize(("family", "text", "content"), AROUND, ids=[f"{c[0]}-{i}" for i, c in enumerate(AROUND)])
def test_one_separator_is_kept_where_text_resumes_after_a_call(family: str, text: str, content: str) -> None:
    reasoning, got, calls, invalid, finish, _ = outcome(family, "around", text)
    assert got == content and calls and all(c[2] for c in calls) and invalid == [] and finish == "tool_calls"


# ---- §4 values typed by the schema -----------------------------------------------------------------

@pytest.mark.parametrize(("text", "schema", "literal", "converted", "failed"), [
    ("42", ParamSchema("integer"), "42", True, False), ("-7", ParamSchema("integer"), "-7", True, False),
    ("042", ParamSchema("integer"), '"042"', False, True), ("4.0", ParamSchema("integer"), '"4.0"', False, True),
    ("forty", ParamSchema("integer"), '"forty"', False, True), ("2.5", ParamSchema("number"), "2.5", True, False),
    ("1e3", ParamSchema("number"), "1e3", True, False), ("true", ParamSchema("boolean"), "true", True, False),
    ("True", ParamSchema("boolean"), '"True"', False, True),
    ('{"a": 1}', ParamSchema("object"), '{"a": 1}', True, False),
    ("[1, 2]", ParamSchema("array"), "[1, 2]", True, False), ("[1, 2]", ParamSchema("object"), '"[1, 2]"', False, True),
    (" 42", ParamSchema("integer"), '" 42"', False, True), ("null", ParamSchema("string", True), "null", True, False),
    ("null", ParamSchema("string"), '"null"', False, False), ("42", ParamSchema("string"), '"42"', False, False),
])
def test_a_string_takes_the_schema_type_only_without_loss(text: str, schema: ParamSchema, literal: str,
                                                          converted: bool, failed: bool) -> None:
    assert tuple(convert(text, schema)) == (literal, converted, failed)


def test_tool_schemas_read_types_nullability_and_untyped_properties() -> None:
    schemas = tool_schemas(TOOLS)
    assert schemas["f"]["n"] == ParamSchema("integer") and schemas["f"]["ns"] == ParamSchema("string", True)
    assert schemas["f"]["any"] == ParamSchema() and set(schemas["g"]) == {"arguments"}
    assert tool_schemas([{"function": {"name": "h", "parameters": {"properties": {
        "v": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}}])["h"]["v"] == ParamSchema("integer", True)


TYPED_ARGS = '{"n": 42, "x": 2.5, "ok": true, "o": {"k": [1]}, "a": [1, 2], "s": "42", "ns": null, "any": 7}'
CONVERTED = ["value_converted"] * 6


def test_dsml_string_values_take_the_schema_type() -> None:
    values = [param("n", "42"), param("x", "2.5"), param("ok", "true"), param("o", '{"k": [1]}'),
              param("a", "[1, 2]"), param("s", "42"), param("ns", "null"), param("any", "7", False)]
    text = "\n\n" + block(invoke("f", *values)) + DS_EOS
    assert outcome("dsml", "dsml-typed", text, TYPED) == ("", "", [("f", TYPED_ARGS, True)], [], "tool_calls",
                                                          CONVERTED)
    # without the request's schema the model's own string="true" stands
    assert outcome("dsml", "dsml-untyped", "\n\n" + block(invoke("f", param("n", "42"))) + DS_EOS)[2] == [
        ("f", '{"n": "42"}', True)]


def test_glm_values_take_the_schema_type() -> None:
    text = glm_call("f", n="42", x="2.5", ok="true", o='{"k": [1]}', a="[1, 2]", s="42", ns="null", any="7") + OBS
    assert outcome("glm", "glm-typed", text, TYPED) == ("", "", [("f", TYPED_ARGS, True)], [], "tool_calls",
                                                        CONVERTED)


def test_a_value_that_cannot_take_its_type_stays_a_string_and_is_counted() -> None:
    assert outcome("glm", "glm-fail", glm_call("f", n="forty", s="x") + OBS, TYPED) == (
        "", "", [("f", '{"n": "forty", "s": "x"}', True)], [], "tool_calls", ["value_not_converted"])
    text = "\n\n" + block(invoke("f", param("n", "4.5"), param("ok", '"true"', False))) + DS_EOS
    assert outcome("dsml", "dsml-fail", text, TYPED) == (
        "", "", [("f", '{"n": "4.5", "ok": true}', True)], [], "tool_calls",
        ["value_not_converted", "value_converted"])


UNWRAP_TOOLS = ParserOptions(schemas=tool_schemas(TOOLS + [{"type": "function", "function": {
    "name": "h", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]))


def test_a_lone_arguments_parameter_outside_the_schema_is_unwrapped() -> None:
    dsml = "\n\n" + block(invoke("h", param("arguments", '{"city": "Oslo"}', False))) + DS_EOS
    assert outcome("dsml", "unwrap-dsml", dsml, UNWRAP_TOOLS) == (
        "", "", [("h", '{"city": "Oslo"}', True)], [], "tool_calls", ["arguments_unwrapped"])
    glm = glm_call("h", input='{"city": "Oslo"}') + OBS
    assert outcome("glm", "unwrap-glm", glm, UNWRAP_TOOLS) == (
        "", "", [("h", '{"city": "Oslo"}', True)], [], "tool_calls", ["arguments_unwrapped"])


def test_arguments_parameters_that_are_not_a_lone_object_stay() -> None:
    in_schema = glm_call("g", arguments='{"a": 1}') + OBS  # g declares `arguments` (a string)
    assert outcome("glm", "keep-declared", in_schema, UNWRAP_TOOLS)[2] == [("g", '{"arguments": "{\\"a\\": 1}"}', True)]
    second = glm_call("h", arguments='{"a": 1}', city="Oslo") + OBS
    assert outcome("glm", "keep-second", second, UNWRAP_TOOLS)[2] == [
        ("h", '{"arguments": {"a": 1}, "city": "Oslo"}', True)]
    unknown_tool = glm_call("zz", arguments='{"a": 1}') + OBS  # no schema for zz: nothing to compare with
    assert outcome("glm", "keep-unknown", unknown_tool, UNWRAP_TOOLS)[2] == [("zz", '{"arguments": {"a": 1}}', True)]
