"""Qwen3 (Hermes-style) tool calls with the real Qwen3 tokenizer and chat template."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import given

from pdserve.parsers import Diag, FinishReason, ParserOptions, ToolsMode, aggregate, prompt_opens_reasoning
from pdserve.parsers.profiles import Format

from tests.parsers import fuzz
from tests.parsers.harness import char_tokenization, normalized, run, run_tracking, splits
from tests.parsers.realtok import Model, load_model
from tests.parsers.templates import completion

END = "<|im_end|>"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'

# name, output, options, length, (reasoning, content, calls, finish, diags)
CASES = [
    ("qwen3-shape", "<think>\nneed tool\n</think>\n\nLet me check.\n" + CALL + END, ParserOptions(), False,
     ("need tool", "Let me check.", [("get_weather", '{"city": "Oslo", "days": 2}', True)], "tool_calls", [])),
    ("arguments-as-string", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>' + END,
     ParserOptions(), False, ("", "", [("f", '{"a": 1}', True)], "tool_calls", [])),
    ("invalid-body", "ok\n<tool_call>\n{\"name\": \"f\", \n</tool_call>" + END, ParserOptions(), False,
     ("", "ok", [], "stop", [Diag.INVALID_CALL])),
    ("invalid-body-strict", "ok\n<tool_call>\n{\"name\": \"f\", \n</tool_call>" + END, ParserOptions(strict=True),
     False, ("", "ok", [], "error", [Diag.INVALID_CALL])),
    ("truncated", "ok\n<tool_call>\n{\"name\": \"f\", \"argu", ParserOptions(), True,
     ("", "ok", [], "length", [Diag.ENDED_INSIDE_BLOCK])),
    ("suppressed", "Sure.\n" + CALL + END, ParserOptions(tools_mode=ToolsMode.SUPPRESS), False,
     ("", "Sure.", [], "stop", [Diag.SUPPRESSED])),
    ("stray-closer", "a</tool_call>b" + END, ParserOptions(), False, ("", "ab", [], "stop", [Diag.STRAY_MARKER])),
    ("think-ids-in-body", '<tool_call>\n{"name": "f", "arguments": {"s": "<think>x</think>"}}\n</tool_call>' + END,
     ParserOptions(), False, ("", "", [("f", '{"s": "<think>x</think>"}', True)], "tool_calls", [])),
    ("call-inside-reasoning", "<think>\nhmm\n" + CALL + END, ParserOptions(), False,
     ("hmm", "", [("get_weather", '{"city": "Oslo", "days": 2}', True)], "tool_calls",
      [Diag.REASONING_CLOSED_IMPLICITLY])),
]


def outcome(events: list) -> tuple:
    agg = aggregate(events)
    calls = [(c.name, c.arguments, c.complete) for c in agg.tool_calls]
    finish = agg.finish_reason.value if agg.finish_reason else None
    return agg.reasoning, agg.content, calls, finish, [d.code for d in agg.diagnostics]


def test_qwen_profile_is_hermes(qwen: Model) -> None:
    p = qwen.profile
    assert p.format is Format.HERMES and p.hermes is not None and p.think is not None
    assert qwen.encode("<tool_call>") == [p.hermes.call_open] and qwen.encode("</tool_call>") == [p.hermes.call_close]
    assert qwen.id("<|im_end|>") in p.eos_ids
    assert qwen.tok.token_to_id("</s>") not in p.eos_ids  # a plain text piece in Qwen's vocabulary


@pytest.mark.parametrize(("name", "text", "options", "length", "expected"), CASES, ids=[c[0] for c in CASES])
def test_hermes_output(qwen: Model, name: str, text: str, options: ParserOptions, length: bool,
                       expected: tuple) -> None:
    ids = qwen.encode(text)
    events = run(qwen, ids, options, length=length)
    assert outcome(events) == expected
    rng = random.Random(name)
    for cuts in splits(len(ids), rng):
        assert run(qwen, ids, options, cuts, length) == events
    per_char = char_tokenization(qwen, text)
    for cuts in splits(len(per_char), rng, two_way_max=24, three_way_max=0):
        assert normalized(run(qwen, per_char, options, cuts, length)) == normalized(events)


def test_qwen3_template_round_trip(qwen: Model) -> None:
    """An assistant turn rendered by the real Qwen3 template parses back to the same message."""
    arguments = {"city": "Oslo", "days": 2, "note": "naïve 😀 <b>"}
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "Let me check.", "reasoning_content": "need tool",
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}},
                                {"type": "function", "function": {"name": "now", "arguments": {}}}]}]
    prompt, output = completion("qwen-3", messages, end="")
    options = ParserOptions(start_in_reasoning=prompt_opens_reasoning(qwen.profile, qwen.encode(prompt)))
    assert not options.start_in_reasoning  # Qwen3 writes <think> itself
    agg = aggregate(run(qwen, qwen.encode(output), options))
    assert (agg.reasoning, agg.content) == ("need tool", "Let me check.")
    assert [(c.name, json.loads(c.arguments)) for c in agg.tool_calls] == [("get_weather", arguments), ("now", {})]
    assert agg.diagnostics == [] and agg.finish_reason is FinishReason.TOOL_CALLS


@fuzz.EXAMPLES
@given(text=fuzz.outputs(fuzz.HERMES_MARKUP, fuzz.HERMES_CONTROL, END), options=fuzz.parser_options(),
       fractions=fuzz.cut_points())
def test_hermes_properties(text: str, options: ParserOptions, fractions: list[float]) -> None:
    """No marker text in content or reasoning; chunking and tokenization invariance; streaming
    equals non-streaming; text hold-back ≤ 2 bytes (the newline separator)."""
    qwen = load_model("qwen-3")
    ids = qwen.encode(text)
    whole = run(qwen, ids, options)
    agg = aggregate(whole)
    for channel in (agg.content, agg.reasoning):
        for word in fuzz.HERMES_WORDS:
            assert word not in channel, (word, channel)
    assert run(qwen, ids, options, fuzz.cuts_for(len(ids), fractions)) == whole
    per_id, pending = run_tracking(qwen, ids, options)
    assert per_id == whole and all(t <= 2 and v == 0 and u <= 3 for t, v, u in pending)
    assert normalized(run(qwen, char_tokenization(qwen, text), options)) == normalized(whole)
