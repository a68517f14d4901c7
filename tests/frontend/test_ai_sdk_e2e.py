"""The Vercel AI SDK (`ai` 6 with `@ai-sdk/openai-compatible`, `@ai-sdk/openai` and
`@ai-sdk/anthropic`, Node.js) as a client of `pdserve serve --mode pd` (the session's server):
text, tool calls, a tool loop, objects, an agent with tools and a typed answer, and a refusal,
over chat completions, the Responses API and the Messages API, streamed and not.

`ai_sdk/client.mjs` runs the calls and prints what the SDK made of each step, with the request
bodies it sent. Each body is sent again here, not streamed: the SDK must report exactly the
server's answer to it (text, calls, finish reason, token counts, or the error's status and message). Every request carries its own
`cache_salt`, so both compute the whole prompt and greedy decoding gives the same tokens."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.frontend.router_cases import API_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

MODEL = "SmolLM2-135M-Instruct"
CLIENT = Path(__file__).parent / "ai_sdk"
CHAT_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool-calls"}  # OpenAI's → the SDK's
MESSAGES_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool-calls"}


@pytest.fixture(scope="module")
def scenarios(pd_server) -> dict[str, dict]:
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the AI SDK is a Node.js library")
    assert (CLIENT / "node_modules" / "ai").is_dir(), "the AI SDK is not installed: `make test` runs npm ci"
    run = subprocess.run(["node", str(CLIENT / "client.mjs"), pd_server.v1, MODEL, API_KEY],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    out = {s["name"]: s for s in json.loads(run.stdout)}
    failed = {name: s["error"] for name, s in out.items() if "error" in s}
    assert not failed, failed
    return out


def replay(server, request: dict) -> dict:
    """The server's answer to a body the SDK sent, not streamed, under a salt of its own."""
    body = {k: v for k, v in request["body"].items() if k not in ("stream", "stream_options")}
    body["cache_salt"] += "-replay"
    r = httpx.post(server.url + request["path"], json=body, timeout=120,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


def chat_step(answer: dict) -> dict:
    """A chat completion as the SDK reports a step."""
    choice = answer["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    return {"text": choice["message"]["content"] or "", "finishReason": CHAT_FINISH[choice["finish_reason"]],
            "toolCalls": [{"name": c["function"]["name"], "input": json.loads(c["function"]["arguments"])}
                          for c in calls],
            "usage": {"input": answer["usage"]["prompt_tokens"], "output": answer["usage"]["completion_tokens"]}}


def responses_step(answer: dict) -> dict:
    """A response as the SDK reports a step."""
    text = "".join(part["text"] for item in answer["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    calls = [item for item in answer["output"] if item["type"] == "function_call"]
    finish = "length" if answer["status"] == "incomplete" else "tool-calls" if calls else "stop"
    return {"text": text, "finishReason": finish,
            "toolCalls": [{"name": c["name"], "input": json.loads(c["arguments"])} for c in calls],
            "usage": {"input": answer["usage"]["input_tokens"], "output": answer["usage"]["output_tokens"]}}


def messages_step(answer: dict) -> dict:
    """An Anthropic message as the SDK reports a step."""
    blocks = answer["content"]
    usage = answer["usage"]
    return {"text": "".join(b["text"] for b in blocks if b["type"] == "text"),
            "finishReason": MESSAGES_FINISH[answer["stop_reason"]],
            "toolCalls": [{"name": b["name"], "input": b["input"]} for b in blocks if b["type"] == "tool_use"],
            "usage": {"input": usage["input_tokens"] + usage["cache_read_input_tokens"],
                      "output": usage["output_tokens"]}}


STEP = {"/v1/chat/completions": chat_step, "/v1/responses": responses_step, "/v1/messages": messages_step}


def served(server, scenario: dict) -> list[dict]:
    """Each step's request as the server answers it."""
    return [STEP[r["path"]](replay(server, r)) for r in scenario["requests"]]


def sent_back(request: dict) -> tuple[dict, dict]:
    """The one call a request carries and the result paired with it by id, in its API's shapes."""
    body = request["body"]
    if request["path"] == "/v1/chat/completions":
        [call] = [c for m in body["messages"] if m["role"] == "assistant" for c in m.get("tool_calls") or []]
        [result] = [m["content"] for m in body["messages"] if m.get("tool_call_id") == call["id"]]
        return json.loads(call["function"]["arguments"]), json.loads(result)
    if request["path"] == "/v1/responses":
        [call] = [i for i in body["input"] if i.get("type") == "function_call"]
        [result] = [i["output"] for i in body["input"] if i.get("type") == "function_call_output"
                    and i["call_id"] == call["call_id"]]
        return json.loads(call["arguments"]), json.loads(result)
    blocks = [b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]]
    [call] = [b for b in blocks if b["type"] == "tool_use"]
    [result] = [b["content"] for b in blocks if b["type"] == "tool_result" and b["tool_use_id"] == call["id"]]
    return call["input"], json.loads(result)


@pytest.mark.parametrize("name", ["chat text", "chat text streamed", "responses text", "messages text streamed"])
def test_text_is_the_servers_answer(pd_server, scenarios, name):
    s = scenarios[name]
    assert s["steps"] == served(pd_server, s)
    assert s["steps"][0]["text"]
    if "parts" in s:  # the deltas add up to it
        assert s["parts"]["text"] == s["steps"][0]["text"]


@pytest.mark.parametrize("name", ["chat tool call streamed", "chat tool call streamed, OpenAI provider"])
def test_a_required_call_streams_into_the_call_the_server_makes(pd_server, scenarios, name):
    s = scenarios[name]
    [answer] = [replay(pd_server, r) for r in s["requests"]]
    assert s["steps"] == [chat_step(answer)]
    assert s["steps"][0]["finishReason"] == "tool-calls"
    # the SDK's input deltas are the arguments the server wrote, byte for byte
    assert list(s["parts"]["toolInput"].values()) == [c["function"]["arguments"]
                                                       for c in answer["choices"][0]["message"]["tool_calls"]]
    assert s["parts"]["types"].count("tool-result") == 1  # the SDK ran the tool on the parsed input
    assert "text-start" not in s["parts"]["types"]  # no empty text part before the call


@pytest.mark.parametrize("name", ["chat tool loop", "responses tool loop streamed", "messages tool loop streamed"])
def test_a_tool_loop_sends_the_result_back_and_answers_it(pd_server, scenarios, name):
    s = scenarios[name]
    assert len(s["requests"]) == 2
    assert s["steps"] == served(pd_server, s)
    call, answer = s["steps"]
    assert call["finishReason"] == "tool-calls" and call["toolCalls"][0]["name"] == "weather"
    assert answer["toolCalls"] == [] and answer["text"]
    # the second request carries the call and the tool's result, in the API's own shapes
    city = call["toolCalls"][0]["input"]["city"]
    assert sent_back(s["requests"][1]) == ({"city": city}, {"city": city, "celsius": 21})


@pytest.mark.parametrize("name", ["chat object", "chat object streamed", "responses object", "messages object"])
def test_an_object_is_the_servers_json(pd_server, scenarios, name):
    s = scenarios[name]
    [request] = s["requests"]
    answer = replay(pd_server, request)
    step = STEP[request["path"]](answer)
    if request["path"] == "/v1/messages":  # the Anthropic provider asks for the object as a tool's input
        assert [c["name"] for c in step["toolCalls"]] == ["json"]
        assert s["object"] == step["toolCalls"][0]["input"]
    else:
        assert s["object"] == json.loads(step["text"])
    assert set(s["object"]) == {"name", "age"} and isinstance(s["object"]["age"], int)


@pytest.mark.parametrize("name", ["chat agent with an output object", "responses agent with an output object streamed"])
def test_an_agent_with_tools_and_an_output_object_calls_then_answers_in_it(pd_server, scenarios, name):
    """Every step sends the tools and the object's format, tool_choice "auto": the model calls
    the tool, the SDK sends its result back, and the next step answers with the object."""
    s = scenarios[name]
    assert len(s["requests"]) == 2
    for request in s["requests"]:
        body = request["body"]
        fmt = body["response_format"]["json_schema"] if "response_format" in body else body["text"]["format"]
        assert (body["tool_choice"], fmt["schema"]["required"]) == ("auto", ["city", "summary"])
    assert s["steps"] == served(pd_server, s)
    call, answer = s["steps"]
    assert (call["finishReason"], [c["name"] for c in call["toolCalls"]]) == ("tool-calls", ["weather"])
    assert (answer["finishReason"], answer["toolCalls"]) == ("stop", [])
    assert s["object"] == json.loads(answer["text"]) and set(s["object"]) == {"city", "summary"}
    city = call["toolCalls"][0]["input"]["city"]
    assert sent_back(s["requests"][1]) == ({"city": city}, {"city": city, "celsius": 21})


def test_a_refusal_is_the_servers_error_streamed_or_not(pd_server, scenarios):
    """A request over the context is a 400 the SDK raises with the server's own message (a
    stream's status waits for its first event, so streaming changes nothing)."""
    s = scenarios["refusals"]
    assert len(s["requests"]) == len(s["refusals"]) == 8  # four providers, streamed and not
    for request, got in zip(s["requests"], s["refusals"]):
        body = {k: v for k, v in request["body"].items() if k not in ("stream", "stream_options")}
        r = httpx.post(pd_server.url + request["path"], json=body, timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 400
        assert (got["status"], got["message"]) == (400, r.json()["error"]["message"]), request["path"]
        assert "maximum context length" in got["message"]
