"""Tool calling end to end: `pdserve serve` with the scripted model and each real tokenizer
(DeepSeek V3.2, DeepSeek V4, GLM-4.7/GLM-5, Qwen3), through router → prefill → KV transfer →
decode → parser → SSE.

One server per tokenizer (module-scoped: only one runs at a time). V3.2 and GLM run in PD mode,
V4 and Qwen colocated; the V4 server streams with --stream-batch 4. Every case compares what the
client gets with the script's meaning (tests/frontend/scripted.py): reasoning, one sentence of
content, two calls. The V3.2 script writes `days` as a string (`string="true">3<`): the request's
schema (integer) makes it 3 again.
"""
from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.frontend.conftest import Server, free_port, serve_command, start_server, stop_server
from tests.frontend.scripted import (CALLS, CONTENT, DSML, FAMILIES, MESSAGES, REASONING, TOOLS, Family,
                                     script_ids, write_scripted_model, write_tokenizer)

pytestmark = pytest.mark.e2e

MODEL = "scripted"
SERVE = {"v32": ("--mode", "pd"), "v4": ("--mode", "colocated", "--stream-batch", "4"),
         "glm": ("--mode", "pd"), "qwen": ("--mode", "colocated")}
EXTRA_TOOL = {"type": "function", "function": {"name": "get_news", "parameters": {"type": "object",
                                                                                   "properties": {}}}}
# Markup of any family that must never reach content or reasoning.
MARKUP = re.compile(r"\uff5cDSML\uff5c|<\uff5c|invoke|parameter name|function_calls|<tool_call>|</tool_call>|"
                    r"<arg_key>|<arg_value>|<think>|</think>|\"name\": \"get_")
TIMEOUT = 300  # the first test of a family also starts its server


@dataclass
class Served:
    name: str
    family: Family
    model_dir: Path
    server: Server


# V3.2 writes the integer as a string: schema typing must return it as an integer.
STRING_DAYS = (f'<{DSML}parameter name="days" string="false">3<', f'<{DSML}parameter name="days" string="true">3<')


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    name = request.param
    script = FAMILIES[name].script
    if name == "v32":
        assert STRING_DAYS[0] in script
        script = script.replace(*STRING_DAYS)
    model_dir = write_scripted_model(FAMILIES[name], tmp_path_factory.mktemp(f"scripted-{name}"), script)
    server = start_server("--model", str(model_dir), "--served-model-name", MODEL, *SERVE[name],
                          log_path=model_dir.parent / f"serve-{name}.log")
    try:
        warm_up(server)
        yield Served(name, FAMILIES[name], model_dir, server)
    finally:
        stop_server(server.proc)


def warm_up(server: Server, timeout_s: float = 60) -> None:
    """One answered request before the tests (on a loaded machine, workers that just started
    may miss a health probe or two)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(f"{server.v1}/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1},
                       timeout=60)
        if r.status_code == 200 or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            return
        time.sleep(0.5)


def body(s: Served, **fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0}
    if s.family.thinking:
        out["chat_template_kwargs"] = s.family.thinking
    return {**out, **fields}


def post(s: Served, **fields: Any) -> dict[str, Any]:
    r = httpx.post(f"{s.server.v1}/chat/completions", json=body(s, **fields), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, payload: dict[str, Any], client: Any = None) -> list[dict[str, Any]]:
    """Every SSE event's JSON (the error object too); checks the stream ends with [DONE] unless
    it ended with an error."""
    events: list[dict[str, Any]] = []
    done = False
    with (client or httpx).stream("POST", url, json={**payload, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            events.append(json.loads(line[len("data: "):]))
    assert done or "error" in events[-1]
    return events


def accumulate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A client's view of a stream (choice 0), checking OpenAI's tool-call delta conventions:
    a call's first delta has index, id, type and name with empty arguments; later ones only
    index and an argument fragment."""
    msg: dict[str, Any] = {"content": "", "reasoning_content": "", "reasoning": "", "tool_calls": {}}
    finish = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            for key in ("content", "reasoning_content", "reasoning"):
                msg[key] += delta.get(key) or ""
            for call in delta.get("tool_calls") or []:
                calls = msg["tool_calls"]
                if call["index"] not in calls:
                    assert call["id"] and call["type"] == "function" and call["function"]["arguments"] == ""
                    calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
                else:
                    assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                    calls[call["index"]]["arguments"] += call["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    assert msg["reasoning"] == msg["reasoning_content"]
    return {"content": msg["content"], "reasoning": msg["reasoning_content"], "finish_reason": finish,
            "calls": [(c["name"], c["arguments"]) for _, c in sorted(msg["tool_calls"].items())]}


def summary(response: dict[str, Any]) -> dict[str, Any]:
    """The non-streaming answer in `accumulate`'s shape."""
    choice = response["choices"][0]
    message = choice["message"]
    assert message.get("reasoning") == message.get("reasoning_content")
    return {"content": message["content"] or "", "reasoning": message.get("reasoning_content") or "",
            "finish_reason": choice["finish_reason"],
            "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]}


def both(s: Served, **fields: Any) -> dict[str, Any]:
    """The same request non-streamed and streamed: equal aggregates; returns the aggregate."""
    plain = summary(post(s, **fields))
    streamed = accumulate(stream(f"{s.server.v1}/chat/completions", body(s, **fields)))
    assert streamed == plain
    return plain


def assert_no_markup(result: dict[str, Any]) -> None:
    assert not MARKUP.search(result["content"]), result["content"]
    assert not MARKUP.search(result["reasoning"]), result["reasoning"]


def parsed_calls(result: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(name, json.loads(arguments)) for name, arguments in result["calls"]]


@pytest.mark.timeout(TIMEOUT)
def test_tool_calls_streamed_and_non_streamed_are_the_same_calls(served: Served) -> None:
    result = both(served, tools=TOOLS)
    assert result["finish_reason"] == "tool_calls"
    assert parsed_calls(result) == CALLS
    assert (result["reasoning"], result["content"]) == (REASONING, CONTENT)
    assert_no_markup(result)


@pytest.mark.timeout(TIMEOUT)
def test_first_delta_of_a_call_names_it_then_fragments_follow(served: Served) -> None:
    chunks = stream(f"{served.server.v1}/chat/completions", body(served, tools=TOOLS))
    first = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks
             if c["choices"] and "id" in (c["choices"][0]["delta"].get("tool_calls") or [{}])[0]]
    assert [(d["index"], d["type"], d["function"]) for d in first] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "get_time", "arguments": ""})]
    assert first[0]["id"] != first[1]["id"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.timeout(TIMEOUT)
def test_without_tools_calls_are_swallowed_and_no_markup_reaches_content(served: Served) -> None:
    result = both(served)
    assert (result["calls"], result["finish_reason"]) == ([], "stop")
    assert (result["reasoning"], result["content"]) == (REASONING, CONTENT)
    assert_no_markup(result)


@pytest.mark.timeout(TIMEOUT)
def test_tool_choice_none_swallows_calls(served: Served) -> None:
    result = both(served, tools=TOOLS, tool_choice="none")
    assert (result["calls"], result["finish_reason"], result["content"]) == ([], "stop", CONTENT)
    assert_no_markup(result)


@pytest.mark.timeout(TIMEOUT)
def test_parallel_tool_calls_false_keeps_the_first_call_only(served: Served) -> None:
    result = both(served, tools=TOOLS, parallel_tool_calls=False)
    assert parsed_calls(result) == CALLS[:1]
    assert result["finish_reason"] == "tool_calls"
    assert_no_markup(result)


@pytest.mark.timeout(TIMEOUT)
def test_max_tokens_inside_a_call_ends_with_length_and_a_partial_call(served: Served) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(served.model_dir / "tokenizer.json"))
    ids = script_ids(served.model_dir)
    full = both(served, tools=TOOLS)["calls"][0][1]
    # Cut right after the token that completes "Paris", inside the first call's arguments.
    cut = next(k for k in range(1, len(ids) + 1) if "Paris" in tok.decode(ids[:k], skip_special_tokens=False))
    result = both(served, tools=TOOLS, max_tokens=cut)
    assert result["finish_reason"] == "length"
    assert result["content"] == CONTENT
    assert_no_markup(result)
    if served.family.atomic:  # a Hermes call is released whole: a truncated one is not shown
        assert result["calls"] == []
    else:
        [(name, arguments)] = result["calls"]
        assert name == "get_weather" and full.startswith(arguments) and "Paris" in arguments
        with pytest.raises(ValueError):  # nothing was invented to close it
            json.loads(arguments)


@pytest.mark.timeout(TIMEOUT)
def test_separate_reasoning_false_puts_reasoning_into_content(served: Served) -> None:
    result = both(served, tools=TOOLS, separate_reasoning=False)
    assert result["reasoning"] == ""
    assert REASONING in result["content"] and result["content"].endswith(CONTENT)
    assert parsed_calls(result) == CALLS
    assert_no_markup(result)


@pytest.mark.timeout(TIMEOUT)
def test_stop_string_cuts_content_before_the_calls(served: Served) -> None:
    result = both(served, tools=TOOLS, stop=["check"])
    assert (result["content"], result["calls"], result["finish_reason"]) == ("Let me ", [], "stop")
    assert result["reasoning"] == REASONING


# tool_choice "required" and named functions are enforced by a grammar of the model's own call
# syntax (pdserve/structured/tool_grammars.py). The script says a sentence of content before
# its calls, which the grammar does not allow: after the reasoning section the scripted model
# is forced into the calls (where its script is masked it takes the lowest allowed id, so the
# tools bound their strings to end). The parser reads the forced markup as any other output.
BOUNDED = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["Europe/Paris", "Asia/Tokyo"]}}, "required": ["tz"]}}},
]


def assert_forced_calls(result: dict[str, Any], tools: list[dict[str, Any]], names: list[str]) -> None:
    """Calls to `names`, whose arguments validate, right after the script's reasoning."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = parsed_calls(result)
    assert [name for name, _ in calls] == names and result["finish_reason"] == "tool_calls", result
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])
    assert (result["reasoning"], result["content"]) == (REASONING, "")
    assert_no_markup(result)


@pytest.mark.timeout(TIMEOUT)
def test_required_tool_choice_forces_a_call_in_the_models_syntax(served: Served) -> None:
    result = both(served, tools=BOUNDED, tool_choice="required", parallel_tool_calls=False)
    assert len(result["calls"]) == 1
    assert_forced_calls(result, BOUNDED, [result["calls"][0][0]])


@pytest.mark.timeout(TIMEOUT)
def test_a_stream_opens_with_null_content_only_where_calls_are_forced(served: Served) -> None:
    """As OpenAI's: a forced call's stream never has text, so a client opens no text part."""
    def opening(**fields: Any) -> dict[str, Any]:
        return stream(f"{served.server.v1}/chat/completions", body(served, **fields))[0]["choices"][0]["delta"]

    assert opening(tools=BOUNDED, tool_choice="required") == {"role": "assistant", "content": None}
    assert opening(tools=BOUNDED, tool_choice={"type": "function", "function": {"name": "get_time"}}) == {
        "role": "assistant", "content": None}
    assert opening(tools=BOUNDED) == {"role": "assistant", "content": ""}


@pytest.mark.timeout(TIMEOUT)
def test_named_tool_choice_forces_a_call_to_that_function(served: Served) -> None:
    result = both(served, tools=BOUNDED, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert_forced_calls(result, BOUNDED, ["get_time"])


@pytest.mark.timeout(TIMEOUT)
def test_a_named_function_the_model_would_not_call_is_the_one_called(served: Served) -> None:
    choice = {"type": "function", "function": {"name": "get_news"}}
    result = both(served, tools=[*TOOLS, EXTRA_TOOL], tool_choice=choice)
    assert parsed_calls(result) == [("get_news", {})]
    assert_forced_calls(result, [EXTRA_TOOL], ["get_news"])


def allowed_tools(mode: str, names: list[str]) -> dict[str, Any]:
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}


@pytest.mark.timeout(TIMEOUT)
def test_allowed_tools_narrow_the_calls_and_keep_every_tool_in_the_prompt(served: Served) -> None:
    """OpenAI's allowed_tools: the model may call only the allowed functions ("required": must
    call one), while the prompt shows every tool, so it is the same prompt, cached prefix and
    all, whichever tools a turn allows."""
    result = both(served, tools=TOOLS, tool_choice=allowed_tools("auto", ["get_time"]))
    assert (parsed_calls(result), result["finish_reason"]) == ([CALLS[1]], "tool_calls")  # get_weather's is dropped
    assert (result["reasoning"], result["content"]) == (REASONING, CONTENT)
    result = both(served, tools=[*TOOLS, EXTRA_TOOL], tool_choice=allowed_tools("required", ["get_news"]),
                  parallel_tool_calls=False)
    assert parsed_calls(result) == [("get_news", {})]
    assert_forced_calls(result, [EXTRA_TOOL], ["get_news"])

    def prompt_tokens(tools: list[dict[str, Any]], choice: Any) -> int:
        return post(served, tools=tools, tool_choice=choice, max_tokens=1)["usage"]["prompt_tokens"]

    everything = prompt_tokens(TOOLS, "required")
    assert prompt_tokens(TOOLS, allowed_tools("required", ["get_time"])) == everything
    assert prompt_tokens([TOOLS[1]], "required") < everything


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("served", ["v4", "glm", "qwen"], indirect=True)  # V3.2's script writes days as a string
def test_auto_with_strict_tools_leaves_valid_calls_and_text_as_they_are(served: Served) -> None:
    """"auto" with strict tools is constrained (free text, calls held to their schemas): the
    script's answer is valid, so it passes unchanged."""
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in BOUNDED]
    result = both(served, tools=strict)
    assert (parsed_calls(result), result["finish_reason"]) == (CALLS, "tool_calls")
    assert (result["reasoning"], result["content"]) == (REASONING, CONTENT)


@pytest.mark.timeout(TIMEOUT)
def test_openai_client_stream_helpers_accumulate_the_calls(served: Served) -> None:
    from openai import OpenAI
    from openai.lib.streaming.chat import ChatCompletionStreamState

    client = OpenAI(base_url=served.server.v1, api_key="unused", max_retries=0)
    extra = {"chat_template_kwargs": served.family.thinking} if served.family.thinking else None
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0,
                                        extra_body=extra) as s:
        done = [e for e in s if e.type == "tool_calls.function.arguments.done"]
        final = s.get_final_completion()
    message = final.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == CALLS
    assert [(e.name, json.loads(e.arguments)) for e in done] == CALLS
    assert final.choices[0].finish_reason == "tool_calls"

    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True,
                                                extra_body=extra):
        state.handle_chunk(chunk)
    again = state.get_final_completion().choices[0].message
    assert [(c.function.name, c.function.arguments) for c in again.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert getattr(again, "reasoning_content", None) == REASONING


@pytest.mark.timeout(TIMEOUT)
def test_stream_batching_1_to_8_gives_identical_aggregates(served: Served) -> None:
    """A router in this process, in front of the served workers, at every --stream-batch."""
    from fastapi.testclient import TestClient

    from pdserve.frontend.app import create_app
    from pdserve.frontend.config import RouterConfig

    workers = served.server.workers()
    urls = ({"worker_urls": [workers["both"]]} if "both" in workers
            else {"prefill_urls": [workers["prefill"]], "decode_urls": [workers["decode"]]})
    config = RouterConfig(model_dir=served.model_dir, served_model_name=MODEL, **urls)
    expected = summary(post(served, tools=TOOLS))
    sizes = []
    with TestClient(create_app(config)) as client:
        for n in range(1, 9):  # the setting is read per request: one router serves every N
            client.app.state.router.config.stream_batch = n
            chunks = stream("/v1/chat/completions", body(served, tools=TOOLS), client)
            assert accumulate(chunks) == expected, f"stream batch {n}"
            sizes.append(len(chunks))
    assert sizes[0] > sizes[-1]  # batching did group tokens


@pytest.mark.timeout(TIMEOUT)
def test_every_choice_parses_its_own_calls(served: Served) -> None:
    response = post(served, tools=TOOLS, n=2)
    calls = [[(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
             for choice in response["choices"]]
    assert calls == [CALLS, CALLS]
    ids = [c["id"] for choice in response["choices"] for c in choice["message"]["tool_calls"]]
    assert len(set(ids)) == 4


@pytest.mark.timeout(120)
def test_serve_refuses_a_tokenizer_without_the_markers_before_starting_workers(tmp_path: Path) -> None:
    tok = write_tokenizer("deepseek-v3.2", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["ScriptedForCausalLM"], "model_type": "glm4_moe", "eos_token_id": 1,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True), "pdserve_script": [30]}))
    proc = subprocess.run([*serve_command(), "--model", str(tmp_path), "--mode", "colocated",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1
    assert "marker '<tool_call>' is not a single token" in proc.stderr
    assert "started worker" not in proc.stderr


def first_id_with(s: Served, text: str) -> int:
    """The first script id whose token holds `text`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(s.model_dir / "tokenizer.json"))
    return next(t for t in script_ids(s.model_dir) if text in tok.decode([t], skip_special_tokens=False))


def reported(s: Served, **fields: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Non-streamed and streamed: the summary (without the reported calls) and the reports."""
    response = post(s, **fields)
    plain = summary(response)
    invalid = response["choices"][0]["message"].get("invalid_tool_calls", [])
    chunks = stream(f"{s.server.v1}/chat/completions", body(s, **fields))
    final = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f.get("invalid_tool_calls", []) for f in final] == [invalid]
    streamed = accumulate(chunks)
    dropped = {r["index"] for r in invalid}
    streamed["calls"] = [c for i, c in enumerate(streamed["calls"]) if i not in dropped]
    assert streamed == plain
    return plain, invalid


# What the model wrote of the first call before "Paris", per family (the text of its report).
CUT_TEXT = {"v32": '{"city": "', "v4": '{"city": "', "glm": '{"city": "', "qwen": '{"name": "get_weather", "arguments": {"city": "'}
CUT_INDEX = {"v32": 0, "v4": 0, "glm": 0, "qwen": None}


@pytest.mark.timeout(TIMEOUT)
def test_a_call_cut_by_an_end_id_is_reported_not_returned(served: Served) -> None:
    """The output ends (a stop id, as EOS would) inside the first call's arguments: no call is
    returned, finish_reason is "stop", the call is reported in `invalid_tool_calls`."""
    result, invalid = reported(served, tools=TOOLS, stop_token_ids=[first_id_with(served, "Paris")])
    assert (result["calls"], result["finish_reason"], result["content"]) == ([], "stop", CONTENT)
    assert_no_markup(result)
    assert [(r["index"], r["name"], r["text"]) for r in invalid] == [
        (CUT_INDEX[served.name], "get_weather", CUT_TEXT[served.name])]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("served", ["glm", "qwen"], indirect=True)  # DSML has no single closer id
def test_a_call_whose_arguments_closed_before_the_end_is_returned(served: Served) -> None:
    """The output ends right where the first call's closer would come: its arguments are
    complete, so it is a call (for Hermes: the body without `</tool_call>`). No single id closes
    only a DSML invoke, so the DSML case is in the parser tests."""
    result, invalid = reported(served, tools=TOOLS, stop_token_ids=[first_id_with(served, "</tool_call>")])
    assert (parsed_calls(result), result["finish_reason"], invalid) == (CALLS[:1], "tool_calls", [])


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("served", ["v32"], indirect=True)  # the script that writes the string value
def test_values_take_the_schema_type_only_when_it_asks(served: Served) -> None:
    """V3.2 wrote `days` as the string "3": the schema's integer makes it 3 (the first test), a
    string schema keeps "3"."""
    tools = json.loads(json.dumps(TOOLS))
    tools[0]["function"]["parameters"]["properties"]["days"]["type"] = "string"
    result = both(served, tools=tools)
    assert parsed_calls(result)[0] == ("get_weather", {"city": "Paris", "days": "3"})


@pytest.mark.timeout(60)
def test_serve_refuses_an_unknown_tool_call_parser_at_once(tiny_llama_dir: str) -> None:
    proc = subprocess.run([*serve_command(), "--model", tiny_llama_dir, "--tool-call-parser", "deepseek_v9",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2
    assert "unknown tool-call parser 'deepseek_v9'; one of deepseek_r1, deepseek_v3," in proc.stderr
