"""DeepSeek-V3.2 prompt encoder: the reference format (docs/dsml.md, "DeepSeek-V3.2"), and round trips
through the real V3.2 tokenizer and the DSML parser."""
from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.frontend.encoders import EncodeError, encode_v32, thinking_from_kwargs
from pdserve.parsers import ParserOptions, aggregate, prompt_opens_reasoning

from tests.parsers.harness import run
from tests.parsers.realtok import load_model

D = "\uff5cDSML\uff5c"
BOS, EOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
USER, ASSISTANT = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}]
ARGUMENTS = [
    {"city": "Beijing", "days": 3},
    {"cmd": 'echo "hi" > C:\\tmp\\out.txt\n\tdone', "code": 'if a<b: print("</div>")'},
    {"text": "naïve café 😀 — 北京 ✓", "tags": ["a", "b"], "opts": {"min": 1.5, "on": True}, "cursor": None},
    {},
    {"s": "", "n": -0.5, "t": "use <think>x</think> tags", "w": "  spaces  "},
]


def call(name: str, arguments: dict[str, Any], call_id: str = "") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_user_turn_opens_or_closes_thinking() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert encode_v32(messages, thinking=True) == f"{BOS}{USER}hi{ASSISTANT}<think>"
    assert encode_v32(messages) == f"{BOS}{USER}hi{ASSISTANT}</think>"
    assert thinking_from_kwargs({"thinking": True}) and not thinking_from_kwargs(None)


def test_tools_are_rendered_into_the_system_prompt() -> None:
    with_system = encode_v32([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], TOOLS)
    assert with_system.startswith(f"{BOS}Be brief.\n\n## Tools\nYou have access to a set of tools")
    assert f'<functions>\n{json.dumps(TOOLS[0]["function"], ensure_ascii=False)}\n</functions>\n{USER}hi' in with_system
    without_system = encode_v32([{"role": "user", "content": "hi"}], TOOLS)
    assert without_system.startswith(f"{BOS}\n\n## Tools\n")  # an empty system message is inserted


def test_tool_calls_and_results_render_in_the_reference_shape() -> None:
    messages = [
        {"role": "user", "content": "Weather in Hangzhou and Beijing?"},
        {"role": "assistant", "content": "", "reasoning_content": "Two calls.",
         "tool_calls": [call("get_weather", {"city": "杭州"}), call("get_weather", {"city": "北京", "days": 2})]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rainy"},
    ]
    expected = (
        f"{BOS}{USER}Weather in Hangzhou and Beijing?{ASSISTANT}<think>Two calls.</think>"
        f"\n\n<{D}function_calls>\n"
        f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">杭州</{D}parameter>\n</{D}invoke>\n'
        f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">北京</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n'
        f"</{D}function_calls>{EOS}"
        "\n\n<function_results>\n<result>sunny</result>\n<result>rainy</result>\n</function_results>\n\n<think>"
    )
    assert encode_v32(messages, thinking=True) == expected


def test_thinking_mode_drops_reasoning_before_the_last_user_turn() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A", "reasoning_content": "old"},
                {"role": "user", "content": "b"}]
    assert encode_v32(messages, thinking=True) == f"{BOS}{USER}a{ASSISTANT}</think>A{EOS}{USER}b{ASSISTANT}<think>"


def test_invalid_conversations_are_refused() -> None:
    with pytest.raises(EncodeError):
        encode_v32([{"role": "tool", "content": "x"}])
    with pytest.raises(EncodeError):
        encode_v32([{"role": "user", "content": "a"}, {"role": "assistant", "content": "no reasoning"}], thinking=True)
    with pytest.raises(EncodeError):
        encode_v32([{"role": "user", "content": "a"},
                    {"role": "assistant", "content": "", "tool_calls": [call("f", {})]},
                    {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}])


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
def test_encoded_tool_calls_parse_back_to_the_same_calls(thinking: bool, strict: bool) -> None:
    v32 = load_model("deepseek-v3.2")
    calls = [call(f"tool_{i}", args, f"id{i}") for i, args in enumerate(ARGUMENTS)]
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"},
                {"role": "assistant", "content": "Calling tools.", "reasoning_content": "Plan it.",
                 "tool_calls": calls}]
    prompt = encode_v32(messages[:-1], TOOLS, thinking=thinking)
    full = encode_v32(messages, TOOLS, thinking=thinking)
    assert full.startswith(prompt)
    options = ParserOptions(strict=strict, start_in_reasoning=prompt_opens_reasoning(v32.profile, v32.encode(prompt)))
    agg = aggregate(run(v32, v32.encode(full[len(prompt):]), options))
    assert agg.diagnostics == []
    assert (agg.reasoning, agg.content) == ("Plan it." if thinking else "", "Calling tools.")
    assert [c.name for c in agg.tool_calls] == [f"tool_{i}" for i in range(len(ARGUMENTS))]
    assert [json.loads(c.arguments) for c in agg.tool_calls] == ARGUMENTS
    assert [c.arguments for c in agg.tool_calls] == [json.dumps(a, ensure_ascii=False) for a in ARGUMENTS]


def test_answer_after_tool_results_parses_as_reasoning_then_content() -> None:
    v32 = load_model("deepseek-v3.2")
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "reasoning_content": "call",
                 "tool_calls": [call("get_weather", {"city": "Oslo"})]},
                {"role": "tool", "content": "cold"},
                {"role": "assistant", "content": "It is cold.", "reasoning_content": "The tool says cold."}]
    prompt = encode_v32(messages[:-1], TOOLS, thinking=True)
    full = encode_v32(messages, TOOLS, thinking=True)
    assert prompt.endswith("</function_results>\n\n<think>") and full.startswith(prompt)
    options = ParserOptions(strict=True, start_in_reasoning=prompt_opens_reasoning(v32.profile, v32.encode(prompt)))
    agg = aggregate(run(v32, v32.encode(full[len(prompt):]), options))
    assert (agg.reasoning, agg.content) == ("The tool says cold.", "It is cold.")
    assert agg.tool_calls == [] and agg.diagnostics == []
