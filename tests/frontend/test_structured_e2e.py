"""Structured outputs through the router (docs/structured-outputs.md).

Without workers (`no_worker_client`): a bad constraint is a 400 naming its field, decided at
the router before anything reaches a worker (a good one gets as far as the missing workers:
503). With `pdserve serve --mode pd` (the default model): JSON Schema, JSON mode, vLLM's
extras and enforced tool choice answer as OpenAI does, streamed and not alike.
"""
from __future__ import annotations

import itertools
import json
import uuid
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings

from tests.frontend.router_cases import API_KEY, CHAT, COMPLETIONS
from tests.structured.strategies import OBJECT_SCHEMAS

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"],
    "additionalProperties": False}}}


def schema_format(schema: Any, strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": strict}}


def ask(content: str = "Tell me about a person.", **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 60, "temperature": 0, **fields}


# ---- the router alone --------------------------------------------------------------------------

BAD = [
    (ask(response_format=schema_format({"type": "foo"})), "response_format", "Invalid type: foo"),
    (ask(response_format=schema_format({"type": "object", "not": {}})), "response_format", "Unimplemented keys"),
    (ask(response_format={"type": "json_schema"}), "response_format", "needs a 'json_schema' object"),
    (ask(response_format={"type": "yaml"}), "response_format", "'yaml'"),
    (ask(structured_outputs={"regex": "[a-"}), "structured_outputs", "unclosed character class"),
    (ask(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one"),
    (ask(guided_choice=[]), "guided_choice", "non-empty list"),
    (ask(tools=[{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "format": "weird"}}}}}], tool_choice="required"),
     "tools", "Unknown format: weird"),
    (ask(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "structured_outputs",
     "only one output constraint"),
]


@pytest.mark.parametrize("body, param, reason", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_a_bad_constraint_is_a_400_naming_its_field_before_any_worker(no_worker_client, body, param, reason):
    r = no_worker_client.post(CHAT, json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and reason in error["message"], error


def test_a_bad_constraint_on_completions_is_a_400_too(no_worker_client):
    r = no_worker_client.post(COMPLETIONS, json={"prompt": "x", "structured_outputs": {"grammar": "start: foo"}},
                              headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"


def test_a_good_constraint_passes_the_router_to_the_missing_workers(no_worker_client):
    r = no_worker_client.post(CHAT, json=ask(response_format=schema_format(PERSON)), headers=AUTH)
    assert r.status_code == 503


# ---- end to end --------------------------------------------------------------------------------


def post(server, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{server.v1}/chat/completions", json=body, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, body: dict[str, Any]) -> tuple[str, dict[int, dict[str, str]], str]:
    """(content, tool calls by index {"id", "name", "arguments"}, finish_reason) of a stream."""
    content, calls, finish = [], {}, None
    with httpx.stream("POST", f"{server.v1}/chat/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or ():
                c = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                c["id"] += call.get("id") or ""
                c["name"] += call.get("function", {}).get("name") or ""
                c["arguments"] += call.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return "".join(content), calls, finish


@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_output_validates_and_streams_the_same(pd_server, strict):
    body = ask(response_format=schema_format(PERSON, strict))
    message = post(pd_server, body)["choices"][0]
    assert message["finish_reason"] == "stop"
    document = json.loads(message["message"]["content"])
    jsonschema.validate(document, PERSON)
    assert list(document) == ["name", "age"]  # the schema's order, not the alphabet's
    content, calls, finish = stream(pd_server, body)
    assert (content, calls, finish) == (message["message"]["content"], {}, "stop")


@pytest.mark.e2e
@pytest.mark.timeout(1200)
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=OBJECT_SCHEMAS)
def test_random_schemas_validate_and_stream_the_same_through_pd(pd_server, schema):
    body = ask("Fill in the form.", response_format=schema_format(schema), max_tokens=300)
    message = post(pd_server, body)["choices"][0]
    assert message["finish_reason"] == "stop", (schema, message)
    document = json.loads(message["message"]["content"])
    jsonschema.validate(document, schema)
    order = list(schema.get("properties", {}))
    assert [k for k in document if k in order] == sorted((k for k in document if k in order), key=order.index)
    assert stream(pd_server, body) == (message["message"]["content"], {}, "stop")


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_logprobs_of_a_constrained_answer_report_ruled_out_tokens_at_the_floor(pd_server):
    """Where the grammar allows one token only (the schema's fixed keys and punctuation), the
    other alternatives' logprob is -inf, which JSON cannot carry: they are -9999.0 (as vLLM
    reports them), streamed and not alike."""
    body = ask(response_format=schema_format(PERSON), logprobs=True, top_logprobs=3)
    entries = post(pd_server, body)["choices"][0]["logprobs"]["content"]
    forced = [e for e in entries if e["top_logprobs"][0]["logprob"] == 0.0]
    assert len(forced) >= 4, entries  # at least `{"name": "` holds forced tokens
    assert all([t["logprob"] for t in e["top_logprobs"][1:]] == [-9999.0, -9999.0] for e in forced)
    streamed = []
    with httpx.stream("POST", f"{pd_server.v1}/chat/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        choice = json.loads(line[6:])["choices"][0]
        streamed += (choice.get("logprobs") or {}).get("content") or []
    # the second run reads its prompt from the cache: the same tokens, logprobs equal to ~1e-4
    assert [e["token"] for e in streamed] == [e["token"] for e in entries]
    assert [e for e in streamed if e["top_logprobs"][0]["logprob"] == 0.0] == forced


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_json_object_mode_greedy_and_sampled_gives_objects(pd_server):
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}):
        choice = post(pd_server, ask("Describe a cat in JSON.", response_format={"type": "json_object"},
                                     max_tokens=200, **sampling))["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_vllm_choice_and_regex(pd_server):
    choice = post(pd_server, ask("Is the sky blue?", structured_outputs={"choice": ["yes", "no"]}))["choices"][0]
    assert choice["message"]["content"] in ("yes", "no") and choice["finish_reason"] == "stop"
    choice = post(pd_server, ask("A date?", structured_outputs={"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}))
    assert __import__("re").fullmatch(r"20\d\d-[01]\d-[0-3]\d", choice["choices"][0]["message"]["content"])


def check_calls(calls: list[dict[str, Any]], tools: list[dict[str, Any]], name: str | None) -> None:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in by_name and (name is None or call["function"]["name"] == name)
        jsonschema.validate(json.loads(call["function"]["arguments"]), by_name[call["function"]["name"]])


@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tool_choice, parallel", [
    ({"type": "function", "function": {"name": "get_weather"}}, None), ("required", False), ("required", None)])
def test_enforced_tool_choice_on_the_default_model_returns_valid_calls(pd_server, tool_choice, parallel):
    tools = [WEATHER, TIME]
    fields = {"tools": tools, "tool_choice": tool_choice, "max_tokens": 80}
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    body = ask("What is the weather in Paris?", **fields)
    choice = post(pd_server, body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    check_calls(calls, tools, "get_weather" if isinstance(tool_choice, dict) else None)
    if parallel is False:
        assert len(calls) == 1
    content, streamed, finish = stream(pd_server, body)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_enforced_tool_choice_cut_by_max_tokens_answers_the_call_as_far_as_it_got(pd_server):
    """A JSON call cut inside its arguments is returned with the arguments written so far and
    finish_reason "length"; one cut inside its name is reported, not returned. Streamed the
    same, and none of the JSON reaches content (docs/tool-calls.md, a cut call)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = ask("What is the weather in Paris?", tools=[WEATHER], tool_choice=named, max_tokens=80)
    whole = post(pd_server, {**body, "logprobs": True})["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    arguments = whole["message"]["tool_calls"][0]["function"]["arguments"]
    # the output as the model's tokens wrote it, one prefix per token count
    texts = list(itertools.accumulate(bytes(t["bytes"]).decode() for t in whole["logprobs"]["content"]))
    head, name_head = '{"name":"get_weather","arguments":', '{"name":"'
    in_args = next(n for n, text in enumerate(texts, 1) if len(text) > len(head))
    in_name = next(n for n, text in enumerate(texts, 1) if len(text) > len(name_head))
    assert len(texts[in_name - 1]) < len('{"name":"get_weather"') and len(texts[in_args - 1]) < len(head + arguments)

    cut = post(pd_server, {**body, "max_tokens": in_args})["choices"][0]
    so_far = texts[in_args - 1][len(head):]
    assert arguments.startswith(so_far) and so_far != arguments
    assert cut["finish_reason"] == "length" and not cut["message"]["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in cut["message"]["tool_calls"]] == \
        [("get_weather", so_far)]
    content, streamed, finish = stream(pd_server, {**body, "max_tokens": in_args})
    assert (content, finish) == ("", "length")
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [("get_weather", so_far)]

    cut = post(pd_server, {**body, "max_tokens": in_name})["choices"][0]
    assert cut["finish_reason"] == "length" and not cut["message"]["content"]
    assert "tool_calls" not in cut["message"]
    assert cut["message"]["invalid_tool_calls"] == [
        {"index": None, "name": texts[in_name - 1][len(name_head):], "text": texts[in_name - 1],
         "reason": "truncated_call_dropped"}]
    content, streamed, finish = stream(pd_server, {**body, "max_tokens": in_name})
    assert (content, streamed, finish) == ("", {}, "length")


# ---- "auto" with a response_format: an agent's tools and its typed answer ----------------------

REPORT = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "summary": {"type": "string", "maxLength": 60}},
          "required": ["city", "summary"], "additionalProperties": False}


def salted(body: dict[str, Any]) -> dict[str, Any]:
    """`body` under a cache_salt of its own: it computes its whole prompt, so a comparison token
    for token cannot be flipped by a near-tie between cached and computed KV."""
    return {**body, "cache_salt": uuid.uuid4().hex}


def calls_of(message: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()]


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_auto_with_a_response_format_calls_a_tool_then_answers_in_the_format(pd_server):
    """An agent with tools and a typed final answer sends both: tool_choice "auto" and a
    response_format. The model may call a tool or answer in the format, as at OpenAI. On the
    first turn the default model calls: the call "required" forces. After the tool's result it
    answers: its whole output is the content, a document of the format. Streamed the same, and
    the Responses API the same. Every request computes its whole prompt (`salted`)."""
    fmt = schema_format(REPORT)
    first = ask("What is the weather in Paris?", tools=[WEATHER, TIME], max_tokens=80)
    choice = post(pd_server, salted({**first, "response_format": fmt}))["choices"][0]
    forced = post(pd_server, salted({**first, "tool_choice": "required"}))["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", None)
    assert calls_of(choice["message"]) == calls_of(forced["message"]) and calls_of(forced["message"])
    content, streamed, finish = stream(pd_server, salted({**first, "response_format": fmt}))
    assert ([(c["name"], c["arguments"]) for c in streamed.values()], content, finish) == \
        (calls_of(choice["message"]), "", "tool_calls")

    call = choice["message"]["tool_calls"][0]
    second = {**first, "messages": [*first["messages"], {"role": "assistant", "content": None, "tool_calls": [call]},
                                    {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 24 degrees"}]}
    answer = post(pd_server, salted({**second, "response_format": fmt, "logprobs": True}))["choices"][0]
    assert (answer["finish_reason"], calls_of(answer["message"])) == ("stop", [])
    # the content is the model's whole output, as its tokens wrote it, up to its end token
    *tokens, end = answer["logprobs"]["content"]
    written = b"".join(bytes(t["bytes"]) for t in tokens).decode()
    assert end["token"] == "<|im_end|>"
    assert answer["message"]["content"] == written
    jsonschema.validate(json.loads(written), REPORT)
    assert stream(pd_server, salted({**second, "response_format": fmt})) == (answer["message"]["content"], {}, "stop")

    # the Responses API: text.format with the same tools, the call, then its output
    text = {"format": {"type": "json_schema", "name": "out", "schema": REPORT, "strict": True}}
    tools = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
    base = {"tools": tools, "text": text, "max_output_tokens": 80, "temperature": 0,
            "store": False}
    r = httpx.post(f"{pd_server.v1}/responses", headers=AUTH, timeout=300,
                   json=salted({**base, "input": first["messages"][0]["content"]}))
    assert r.status_code == 200, r.text
    [item] = r.json()["output"]
    assert (item["type"], item["name"], item["arguments"]) == ("function_call", *calls_of(choice["message"])[0])
    r = httpx.post(f"{pd_server.v1}/responses", headers=AUTH, timeout=300, json=salted({**base, "input": [
        {"role": "user", "content": first["messages"][0]["content"]}, item,
        {"type": "function_call_output", "call_id": item["call_id"], "output": "Sunny, 24 degrees"}]}))
    assert r.status_code == 200, r.text
    [message] = r.json()["output"]
    assert [p["text"] for p in message["content"]] == [answer["message"]["content"]]
