"""Anthropic's Messages API through `pdserve serve` (PD) and the official `anthropic` SDK (which
authenticates with `x-api-key`): a message is the chat completion of the same conversation
(greedy, token for token, the same token counts); the SDK's stream helper rebuilds the same
message; a stop sequence, a forced tool use and its result, a prefill, a JSON-schema output and
count_tokens match their chat counterparts; errors come in Anthropic's shape."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.frontend.router_cases import API_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK sends sampling settings only this way
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                            "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(pd_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=pd_server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(pd_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=120)


def tokens(usage) -> tuple[int, int]:
    """(prompt tokens, output tokens): Anthropic counts the cached part of the prompt apart."""
    return usage.input_tokens + usage.cache_read_input_tokens, usage.output_tokens


@pytest.mark.parametrize("limit, reason", [(6, "max_tokens"), (80, "end_turn")])
def test_a_message_is_the_chat_completion_of_the_same_conversation(client, chat, limit, reason):
    m = client.messages.create(model=MODEL, max_tokens=limit, system="Be brief.",
                               messages=[{"role": "user", "content": "Say hi"}], **GREEDY)
    c = chat.chat.completions.create(model=MODEL, max_tokens=limit, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}])
    assert c.choices[0].finish_reason == {"max_tokens": "length", "end_turn": "stop"}[reason]
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert (m.stop_reason, m.stop_sequence) == (reason, None)
    [block] = m.content
    assert block.type == "text" and block.text == c.choices[0].message.content
    assert tokens(m.usage) == (c.usage.prompt_tokens, c.usage.completion_tokens)


def test_a_streamed_message_is_the_same_message(client):
    whole = client.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Say hi"}],
                                   **GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Say hi"}],
                                **GREEDY) as stream:
        raw = [e.type for e in stream if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                    "content_block_stop", "message_delta", "message_stop")]
        final = stream.get_final_message()
    deltas = raw.count("content_block_delta")
    assert raw == ["message_start", "content_block_start", *["content_block_delta"] * deltas, "content_block_stop",
                   "message_delta", "message_stop"] and deltas > 1
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in whole.content]
    assert final.stop_reason == whole.stop_reason == "end_turn"
    assert tokens(final.usage) == tokens(whole.usage)
    # the same prompt again: its full blocks come from the prefix cache, and the stream's last
    # usage says so (message_start could not know it)
    assert final.usage.cache_read_input_tokens > 0


def test_a_cache_salt_shares_cached_blocks_only_with_its_own(client):
    """vLLM's `cache_salt`, in the SDK's `extra_body` as on chat."""
    ask = dict(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Name a planet, " + "and " * 40}])

    def cached(salt: str) -> int:
        m = client.messages.create(**ask, extra_body={"temperature": 0, "cache_salt": salt})
        return m.usage.cache_read_input_tokens

    assert cached("tenant-a") == 0  # nothing under this salt yet, though the prompt may be cached unsalted
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


def test_a_stop_sequence_is_named(client, chat):
    question = [{"role": "user", "content": "Count from 1 to 10."}]
    c = chat.chat.completions.create(model=MODEL, messages=question, max_tokens=60, temperature=0)
    text = c.choices[0].message.content
    stop = text.split()[len(text.split()) // 2]  # a word from the middle of the greedy answer
    m = client.messages.create(model=MODEL, max_tokens=60, messages=question, stop_sequences=[stop], **GREEDY)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == text[:text.index(stop)]


def test_a_tool_use_and_its_result_continue_the_conversation_as_chat_does(client, chat):
    m = client.messages.create(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": QUESTION}],
                               tools=[WEATHER], tool_choice={"type": "any"}, **GREEDY)
    c = chat.chat.completions.create(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": QUESTION}],
                                     tools=[CHAT_WEATHER], tool_choice="required", temperature=0)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses
    assert [(u.name, u.input) for u in uses] == [(t.function.name, json.loads(t.function.arguments))
                                                 for t in c.choices[0].message.tool_calls]
    with client.messages.stream(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": QUESTION}],
                                tools=[WEATHER], tool_choice={"type": "any"}, **GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(u.name, u.input) for u in streamed.content] == [(u.name, u.input) for u in uses]

    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "Sunny, 21 C"} for u in uses]
    after = client.messages.create(model=MODEL, max_tokens=40, tools=[WEATHER], **GREEDY, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": m.content},
        {"role": "user", "content": results}])
    chat_after = chat.chat.completions.create(model=MODEL, max_tokens=40, tools=[CHAT_WEATHER], temperature=0, messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
            for u in uses]},
        *[{"role": "tool", "tool_call_id": r["tool_use_id"], "content": r["content"]} for r in results]])
    assert tokens(after.usage)[0] == chat_after.usage.prompt_tokens
    assert after.content[0].text == chat_after.choices[0].message.content

    count = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": m.content},
        {"role": "user", "content": results}])
    assert count.input_tokens == chat_after.usage.prompt_tokens


def test_a_prefill_is_continued_as_chat_continues_a_final_message(client, chat):
    turns = [{"role": "user", "content": "Name three colors."}, {"role": "assistant", "content": "Sure! The first is"}]
    m = client.messages.create(model=MODEL, max_tokens=30, messages=turns, **GREEDY)
    c = chat.chat.completions.create(model=MODEL, max_tokens=30, temperature=0, messages=turns,
                                     extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert m.content[0].text == c.choices[0].message.content and m.content[0].text  # what follows, alone
    assert tokens(m.usage) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    closed = chat.chat.completions.create(model=MODEL, max_tokens=30, temperature=0, messages=turns)
    assert closed.usage.prompt_tokens > c.usage.prompt_tokens  # the turn closed, a new one opened


def test_a_json_schema_output_holds(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Describe a person."}],
                               output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY)
    assert m.stop_reason == "end_turn"
    value = json.loads(m.content[0].text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_errors_come_in_anthropics_shape(client, pd_server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                       "message": "The model `claude-x` does not exist."}}
    wrong = anthropic.Anthropic(base_url=pd_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
