"""DeepSeek V3/R1 and V3.1 tool calls end to end: `pdserve serve` with the scripted model and the
real V3 and V3.1 tokenizers (their bundled chat templates), through router → worker → parser → SSE.

One colocated server per tokenizer. Its script is two answers separated by EOS: the first (what
any prompt gets) is a sentence of content and two calls; the second (`CUT`) a call that EOS cuts
inside its arguments. The scripted model continues its script from wherever the prompt's last
ids leave it, so a request whose final assistant message (continue_final_message) is the
sentence gets the calls without text before them, and one whose final message is the whole first
answer and EOS gets the cut call.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.frontend.conftest import Server, start_server, stop_server
from tests.frontend.scripted import CALLS, CONTENT, MESSAGES, TOOLS, Family, write_scripted_model
from tests.frontend.test_tools_e2e import MARKUP, stream, warm_up

pytestmark = pytest.mark.e2e

MODEL = "scripted"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
BLOCK, END_BLOCK = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL, END_CALL, SEP = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>", \
    "<\uff5ctool\u2581sep\uff5c>"
CUT_ARGUMENTS = '{"city": "Par'
TIMEOUT = 300


def v31_call(name: str, arguments: str, closed: bool = True) -> str:
    return f"{CALL}{name}{SEP}{arguments}" + (END_CALL if closed else "")


def v3_call(name: str, arguments: str, closed: bool = True) -> str:
    return f"{CALL}function{SEP}{name}\n```json\n{arguments}" + (f"\n```{END_CALL}" if closed else "")


def answers(call: Any, between: str) -> tuple[str, str]:
    """(the first answer: content then both calls; the cut one)."""
    calls = between.join(call(name, json.dumps(args)) for name, args in CALLS)
    return f"{CONTENT}{BLOCK}{calls}{END_BLOCK}", f"{BLOCK}{call('get_weather', CUT_ARGUMENTS, closed=False)}"


SCRIPTS = {"v3": ("deepseek-v3", answers(v3_call, "\n")), "v31": ("deepseek-v3.1", answers(v31_call, ""))}


@dataclass
class Served:
    name: str
    first: str  # the first answer's text
    server: Server


@pytest.fixture(scope="module", params=list(SCRIPTS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    name = request.param
    key, (first, cut) = SCRIPTS[name]
    family = Family(key, "deepseek_v3", EOS, first + EOS + cut)
    model_dir = write_scripted_model(family, tmp_path_factory.mktemp(f"scripted-{name}"))
    server = start_server("--model", str(model_dir), "--served-model-name", MODEL, "--mode", "colocated",
                          log_path=model_dir.parent / f"serve-{name}.log")
    try:
        warm_up(server)
        yield Served(name, first, server)
    finally:
        stop_server(server.proc)


def body(*, after: str | None = None, **fields: Any) -> dict[str, Any]:
    """`after`: the prompt ends with this assistant text (the script continues from there)."""
    out: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "tools": TOOLS, **fields}
    if after is not None:
        out.update(messages=[*MESSAGES, {"role": "assistant", "content": after}], add_generation_prompt=False,
                   continue_final_message=True)
    return out


def summary(response: dict[str, Any]) -> dict[str, Any]:
    choice = response["choices"][0]
    message = choice["message"]
    return {"content": message["content"] or "", "finish_reason": choice["finish_reason"],
            "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []],
            "invalid": message.get("invalid_tool_calls", [])}


def accumulate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A client's view of a stream: calls by index, less those the final chunk reports invalid."""
    content, calls, invalid, finish = "", {}, [], None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call.get("function", {}).get("name") or ""
                entry["arguments"] += call.get("function", {}).get("arguments") or ""
            invalid += choice.get("invalid_tool_calls") or []
            finish = choice["finish_reason"] or finish
    for report in invalid:
        calls.pop(report["index"], None)
    return {"content": content, "finish_reason": finish, "invalid": invalid,
            "calls": [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]}


def both(s: Served, **fields: Any) -> dict[str, Any]:
    """Non-streamed and streamed: the same message; returns it."""
    r = httpx.post(f"{s.server.v1}/chat/completions", json=body(**fields), timeout=60)
    assert r.status_code == 200, r.text
    plain = summary(r.json())
    assert accumulate(stream(f"{s.server.v1}/chat/completions", body(**fields))) == plain
    assert not MARKUP.search(plain["content"]), plain["content"]
    return plain


@pytest.mark.timeout(TIMEOUT)
def test_calls_after_text_are_calls_and_the_text_is_content(served: Served) -> None:
    result = both(served)
    assert result == {"content": CONTENT, "finish_reason": "tool_calls", "invalid": [],
                      "calls": [(name, json.dumps(args)) for name, args in CALLS]}


@pytest.mark.timeout(TIMEOUT)
def test_calls_without_text_before_them(served: Served) -> None:
    result = both(served, after=CONTENT)
    assert result == {"content": "", "finish_reason": "tool_calls", "invalid": [],
                      "calls": [(name, json.dumps(args)) for name, args in CALLS]}


@pytest.mark.timeout(TIMEOUT)
def test_a_call_cut_by_eos_is_reported_not_returned(served: Served) -> None:
    result = both(served, after=served.first + EOS)
    assert result == {"content": "", "finish_reason": "stop", "calls": [],
                      "invalid": [{"index": 0, "name": "get_weather", "text": CUT_ARGUMENTS,
                                   "reason": "ended_inside_block"}]}


@pytest.mark.timeout(TIMEOUT)
def test_the_model_is_told_the_tools(served: Served) -> None:
    """The bundled templates ignore `tools`; the prompt carries them (prompt tokens grow)."""
    without = httpx.post(f"{served.server.v1}/chat/completions",
                         json={**body(), "tools": None, "max_tokens": 1}, timeout=60).json()
    with_tools = httpx.post(f"{served.server.v1}/chat/completions", json={**body(), "max_tokens": 1},
                            timeout=60).json()
    assert with_tools["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"] + 100
