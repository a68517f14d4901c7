"""Anthropic's Messages API without workers: a request's blocks as the chat request that answers
it, parser events as content blocks and stream events, errors in Anthropic's shape (messages.py)."""
from __future__ import annotations

import json

import pytest

from pdserve.frontend.choices import Batch, ChoiceEvent
from pdserve.frontend.errors import APIError, anthropic_body, body_for, unavailable
from pdserve.frontend.output import OutputDelta
from pdserve.frontend.messages import MessagesRenderer, chat_request
from pdserve.frontend.protocol import MessagesRequest
from pdserve.parsers import ContentDelta, InvalidCall, ReasoningDelta, ToolCallArgs, ToolCallEnd, ToolCallStart

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_blocks_become_the_chat_messages_of_one_conversation():
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 30, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "stop_sequences": ["END"], "temperature": 0.5, "top_k": 5, "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Two cities.", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "rain"}],
                 "is_error": False},
                {"type": "text", "text": "And tomorrow?"}]},
        ]})
    chat = chat_request(req)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "rain"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                           "parameters": WEATHER["input_schema"]}}]
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.stop) == (30, 0.5, 5, ["END"])
    named = chat_request(req.model_copy(update={"tool_choice": {"type": "tool", "name": "get_weather"}}))
    assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat.continue_final_message, chat.add_generation_prompt) == (False, True)


@pytest.mark.parametrize("fields, kwargs, effort", [
    ({}, None, None),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, {"thinking": True, "enable_thinking": True}, None),
    ({"thinking": {"type": "disabled"}, "output_config": {"effort": "max"}},
     {"thinking": False, "enable_thinking": False}, "max"),
])
def test_thinking_and_effort_become_the_templates_switch_and_reasoning_effort(fields, kwargs, effort):
    chat = chat_request(MessagesRequest.model_validate({"max_tokens": 9, "messages": [
        {"role": "user", "content": "Hi"}], **fields}))
    assert (chat.chat_template_kwargs, chat.reasoning_effort) == (kwargs, effort)


def test_a_final_assistant_text_is_a_prefill_the_model_continues():
    def chat_of(*messages):
        return chat_request(MessagesRequest.model_validate({"max_tokens": 9, "messages": list(messages)}))

    question = {"role": "user", "content": "Name a color."}
    prefill = chat_of(question, {"role": "assistant", "content": [{"type": "text", "text": "My answer: "},
                                                                  {"type": "text", "text": "the color"}]})
    assert (prefill.continue_final_message, prefill.add_generation_prompt) == (True, False)
    assert prefill.messages[-1].content == "My answer: the color"
    # a final turn of tool calls is no prefill: the template closes it as it closes any turn
    called = chat_of(question, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]})
    assert (called.continue_final_message, called.add_generation_prompt) == (False, True)
    with pytest.raises(APIError) as e:  # Anthropic refuses it too
        chat_of(question, {"role": "assistant", "content": "Blue "})
    assert (e.value.status, e.value.param) == (400, "messages[1].content")


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]},
     "messages[0].content[0].input"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "s"}]},
     "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": {"type": "tool"}},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": [f"s{i}" for i in range(17)]},
     "stop_sequences"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"messages": [{"role": "user", "content": "x"}],
      "mcp_servers": [{"type": "url", "url": "https://m", "name": "m"}]}, "mcp_servers"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "extreme"}}, "output_config.effort"),
])
def test_what_cannot_be_expressed_is_refused_with_its_field(body, param):
    with pytest.raises(APIError) as e:
        chat_request(MessagesRequest.model_validate({"max_tokens": 5, **body}))
    assert e.value.status == 400 and e.value.param == param


def test_errors_take_anthropics_shape_on_its_paths_only():
    error = unavailable("no decode worker")
    assert anthropic_body(error) == {"type": "error", "error": {"type": "overloaded_error",
                                                                "message": "no decode worker"}}
    assert body_for("/v1/messages/count_tokens", APIError("bad", 400))["error"]["type"] == "invalid_request_error"
    assert body_for("/v1/chat/completions", error) == error.body()


def renderer() -> MessagesRenderer:
    return MessagesRenderer("msg_1", "m", 12, None)


def event(parts, tokens: int, finish: str | None = None, stop: str | None = None) -> ChoiceEvent:
    return ChoiceEvent(0, Batch(OutputDelta(parts=parts), list(range(tokens))), finish, None, tokens,
                       cached_tokens=8 if finish else None, stop_sequence=stop)


def test_events_open_one_block_per_run_in_the_order_the_model_wrote_them():
    r = renderer()
    [start] = r.opening()
    assert start["type"] == "message_start" and start["message"]["content"] == []
    events = r.absorb(event([ReasoningDelta("Think"), ReasoningDelta("ing."), ContentDelta("Let me check.")], 3))
    events += r.absorb(event([ToolCallStart(0, "toolu_a", "get_weather"), ToolCallArgs(0, '{"city": '),
                              ToolCallArgs(0, '"Oslo"}'), ToolCallEnd(0, True)], 5, "tool_calls"))
    events += r.closing()
    assert [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in events] == [
        ("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, None), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("message_delta", None, None), ("message_stop", None, None)]
    final = r.response()
    assert final["content"] == [{"type": "thinking", "thinking": "Thinking.", "signature": ""},
                                {"type": "text", "text": "Let me check."},
                                {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Oslo"}}]
    assert (final["stop_reason"], final["stop_sequence"]) == ("tool_use", None)
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    # Anthropic counts cached prompt tokens apart from the rest
    assert final["usage"] == {"input_tokens": 4, "output_tokens": 5, "cache_read_input_tokens": 8,
                              "cache_creation_input_tokens": 0}
    assert events[-2]["usage"] == final["usage"]  # the cached part is known only at the end


@pytest.mark.parametrize("finish, stop, reason", [("stop", None, "end_turn"), ("stop", "END", "stop_sequence"),
                                                  ("length", None, "max_tokens")])
def test_the_stop_reason_says_why_the_output_ended(finish, stop, reason):
    r = renderer()
    r.absorb(event([ContentDelta("Hi")], 1, finish, stop))
    final = r.response()
    assert (final["stop_reason"], final["stop_sequence"]) == (reason, stop)


def test_an_invalid_call_is_never_a_tool_use_block():
    r = renderer()
    r.absorb(event([ContentDelta("Sure."), ToolCallStart(0, "toolu_a", "get_weather"), ToolCallArgs(0, '{"ci')], 4))
    r.absorb(event([InvalidCall(0, "get_weather", '{"ci', "bad_arguments")], 5, "stop"))
    final = r.response()
    assert final["content"] == [{"type": "text", "text": "Sure."}]
    assert [c["name"] for c in final["invalid_tool_calls"]] == ["get_weather"]


def test_a_failure_mid_stream_is_an_error_event():
    r = renderer()
    r.absorb(event([ContentDelta("Hel")], 1))
    name, data = r.failure(unavailable("the decode worker was lost")).strip().split("\n")
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "the decode worker was lost"}}
