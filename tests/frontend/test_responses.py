"""The Responses API without workers: a request's items as the chat request that answers it, and
parser events as output items and stream events (responses.py)."""
from __future__ import annotations

import pytest

from pdserve.frontend.choices import Batch, ChoiceEvent
from pdserve.frontend.errors import APIError
from pdserve.frontend.output import OutputDelta
from pdserve.frontend.protocol import ChatCompletionRequest, ResponsesRequest
from pdserve.frontend.response_store import ResponseStore
from pdserve.frontend.responses import ResponsesRenderer, chat_request, history, resolve_references
from pdserve.parsers import ContentDelta, InvalidCall, ReasoningDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from pdserve.worker_api import TokenLogprob

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}


def test_items_become_the_chat_messages_of_one_conversation():
    req = ResponsesRequest.model_validate({
        "instructions": "Be brief.", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 30, "temperature": 0.5, "seed": 7,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                         {"type": "input_text", "text": "Paris and Rome?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
            {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": "{}"},
        ]})
    chat = chat_request(req)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
    ]
    assert chat.tools == [{"type": "function", "function": {k: WEATHER[k] for k in
                                                           ("name", "description", "parameters", "strict")}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat.output_limit, chat.temperature, chat.seed, chat.n) == (30, 0.5, 7, 1)
    effort = chat_request(ResponsesRequest.model_validate({"input": "x", "reasoning": {"effort": "high"}}))
    assert (chat.reasoning_effort, effort.reasoning_effort) == (None, "high")


def test_text_format_becomes_the_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = ResponsesRequest.model_validate({"input": "x", "text": {"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}}})
    assert chat_request(req).response_format == {"type": "json_schema",
                                                 "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    req = ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "json_object"}}})
    assert chat_request(req).response_format == {"type": "json_object"}


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role"),
    ({"input": ["just a string"]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0]"),
    ({"input": "x", "text": {"format": "json"}}, "text.format"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
])
def test_what_cannot_be_expressed_is_refused_with_its_field(body, param):
    with pytest.raises(APIError) as e:
        chat_request(ResponsesRequest.model_validate(body))
    assert e.value.status == 400 and e.value.param == param


def renderer() -> ResponsesRenderer:
    req = ResponsesRequest.model_validate({"input": "x", "tools": [WEATHER], "max_output_tokens": 50})
    return ResponsesRenderer("resp_1", "m", 12, None, req)


def event(parts, tokens: int, finish: str | None = None) -> ChoiceEvent:
    return ChoiceEvent(0, Batch(OutputDelta(parts=parts), list(range(tokens))), finish, None, tokens,
                       cached_tokens=4 if finish else None)


def test_events_open_one_item_per_run_in_the_order_the_model_wrote_them():
    r = renderer()
    opening = r.opening()
    assert [e["type"] for e in opening] == ["response.created", "response.in_progress"]
    assert opening[0]["response"]["status"] == "in_progress" and opening[0]["response"]["output"] == []
    events = r.absorb(event([ReasoningDelta("Think"), ReasoningDelta("ing."), ContentDelta("Let me check.")], 3))
    events += r.absorb(event([ToolCallStart(0, "call_a", "get_weather"), ToolCallArgs(0, '{"city": '),
                              ToolCallArgs(0, '"Oslo"}'), ToolCallEnd(0, True)], 5, "tool_calls"))
    events += r.closing()
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1), ("response.output_text.delta", 1),
        ("response.output_text.done", 1), ("response.content_part.done", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2), ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2), ("response.completed", None)]
    assert [e["sequence_number"] for e in opening + events] == list(range(len(opening + events)))
    final = r.response()
    assert events[-1]["response"] == final
    reasoning, message, call = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert message["content"] == [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]
    assert {k: call[k] for k in ("type", "call_id", "name", "arguments", "status")} == {
        "type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Oslo"}',
        "status": "completed"}
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final["output"]
    assert final["status"] == "completed" and final["incomplete_details"] is None
    assert final["usage"] == {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 5,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 17}


def test_logprobs_go_with_the_text_their_tokens_wrote(tokenizer):
    """A message's logprobs are its text's tokens: a token whose text was held back goes with
    the text when it comes out; tokens of reasoning and calls, markers, and white space the
    parser dropped before a call are not the message's. Streamed in the text deltas (without
    bytes), in full in the output part."""
    req = ResponsesRequest.model_validate({"input": "x", "tools": [WEATHER], "top_logprobs": 1,
                                           "include": ["message.output_text.logprobs"]})
    assert chat_request(req).logprobs and chat_request(req).top_logprobs == 1
    r = ResponsesRenderer("resp_1", "m", 12, tokenizer, req)
    ids = iter(range(100, 200))
    special = tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.is_special(special)
    # (token id, the parts its push gave) as a parsed decoder gives them, batched as streamed
    script = [
        [(special, []), (next(ids), [ReasoningDelta("Hmm.")]), (special, [])],   # <think> Hmm. </think>
        [(next(ids), []), (next(ids), [ContentDelta("\n\nHi")])],               # a newline held, then text
        [(next(ids), []), (next(ids), [ContentDelta("é")]), (next(ids), [])],     # é in two tokens; a held newline
        [(special, [ToolCallStart(0, "call_a", "get_weather")]), (next(ids), [ToolCallArgs(0, "{}")])],
    ]
    events = []
    for tokens in script:
        batch = Batch()
        for token_id, parts in tokens:
            batch.add(token_id, OutputDelta(parts=parts),
                      TokenLogprob(token_id=token_id, logprob=-0.5, top=[(token_id, -0.5), (7, -1.0)]))
        events += r.absorb(ChoiceEvent(0, batch, None, None, 0))
    batch = Batch()
    batch.add(None, OutputDelta(parts=[ToolCallEnd(0, True)]), None)
    events += r.absorb(ChoiceEvent(0, batch, "tool_calls", None, 10))
    text = [tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in (101, 102, 103, 104)]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [d["delta"] for d in deltas] == ["\n\nHi", "é"]
    assert [[lp["token"] for lp in d["logprobs"]] for d in deltas] == [text[:2], text[2:]]
    assert deltas[0]["logprobs"][0] == {"token": text[0], "logprob": -0.5, "top_logprobs": [
        {"token": text[0], "logprob": -0.5}]}
    part = r.response()["output"][1]["content"][0]
    assert [lp["token"] for lp in part["logprobs"]] == text
    assert part["logprobs"][3] == {"token": text[3], "logprob": -0.5, "bytes": list(tokenizer.token_bytes(104)),
                                   "top_logprobs": [{"token": text[3], "logprob": -0.5,
                                                     "bytes": list(tokenizer.token_bytes(104))}]}
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == deltas[0]["logprobs"] + deltas[1]["logprobs"]
    assert r.response()["top_logprobs"] == 1


def test_a_cut_output_is_incomplete_and_an_invalid_call_is_never_a_call_to_run():
    r = renderer()
    r.absorb(event([ContentDelta("Sure."), ToolCallStart(0, "call_a", "get_weather"), ToolCallArgs(0, '{"ci')], 4))
    events = r.absorb(event([InvalidCall(0, "get_weather", '{"ci', "bad_arguments"),
                             InvalidCall(None, "get_time", "{", "bad_arguments")], 6, "length"))
    assert [e["type"] for e in events] == ["response.function_call_arguments.done", "response.output_item.done"]
    final = r.response()
    message, call = final["output"]
    assert message["status"] == "completed"  # another item followed it: the cut came later
    assert call["status"] == "incomplete" and events[-1]["item"]["status"] == "incomplete"
    assert [c["name"] for c in final["invalid_tool_calls"]] == ["get_weather", "get_time"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r.closing()[0]["type"] == "response.incomplete"


def test_a_failure_mid_stream_closes_the_open_item_and_ends_with_response_failed():
    r = renderer()
    r.absorb(event([ContentDelta("Hel")], 1))
    text = r.failure(APIError("the decode worker was lost", 503, "service_unavailable", None, "worker_lost"))
    blocks = [b for b in text.split("\n\n") if b]
    assert [b.split("\n")[0] for b in blocks] == ["event: response.output_text.done", "event: response.content_part.done",
                                                  "event: response.output_item.done", "event: response.failed"]
    final = r.response()
    assert final["status"] == "failed" and final["output"][0]["status"] == "incomplete"
    assert final["error"] == {"code": "worker_lost", "message": "the decode worker was lost"}


# ---- stored responses (response_store.py) ----------------------------------------------------------


def ended(store: ResponseStore | None, before=(), body=None, rid: str = "resp_1") -> ResponsesRenderer:
    """A response that wrote a reasoning item, text, one valid and one invalid call, then ended."""
    req = ResponsesRequest.model_validate(body or {"input": "Weather?", "tools": [WEATHER]})
    r = ResponsesRenderer(rid, "m", 12, None, req, before, store)
    r.absorb(event([ReasoningDelta("Hm."), ContentDelta("Checking."), ToolCallStart(0, "call_a", "get_weather"),
                    ToolCallArgs(0, '{"city": "Oslo"}'), ToolCallEnd(0, True),
                    ToolCallStart(1, "call_b", "get_weather"), ToolCallArgs(1, "{"),
                    InvalidCall(1, "get_weather", "{", "bad_arguments")], 9, "tool_calls"))
    r.done()
    return r


def test_a_stored_response_keeps_its_conversation_less_the_calls_nobody_ran():
    store = ResponseStore(4)
    r = ended(store)
    stored = store.get("resp_1")
    assert stored.response == r.response() and stored.response["store"] is True
    assert [(item.get("type"), item.get("role"), item.get("call_id")) for item in stored.conversation] == [
        ("message", "user", None), ("reasoning", None, None), ("message", "assistant", None),
        ("function_call", None, "call_a")]
    # the continuation: what came before, then the new input, under the new instructions
    req = ResponsesRequest.model_validate({"instructions": "Be brief.", "previous_response_id": "resp_1", "input": [
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"}]})
    messages = [m.model_dump(exclude_none=True) for m in chat_request(req, history(store, req)).messages]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"}]
    # a chain: the second response's conversation holds the first's, then its own turn
    ended(store, history(store, req), req.model_dump(exclude_none=True), "resp_2")
    second = store.get("resp_2")
    assert second.response["previous_response_id"] == "resp_1"
    assert second.conversation[:4] == stored.conversation and len(second.conversation) == 8
    given = {k: v for k, v in second.conversation[4].items() if k != "id"}
    assert given == {"type": "function_call_output", "call_id": "call_a", "output": "sunny"}
    assert second.conversation[4]["id"].startswith("fco_")  # stored input items get ids, as OpenAI's
    assert second.inputs == second.conversation[:5]
    assert store.get("resp_1").conversation == stored.conversation  # the first is unchanged


def test_store_false_a_failure_and_a_full_store_keep_nothing_more():
    store = ResponseStore(2)
    ended(None, body={"input": "x", "store": False})
    assert len(store) == 0
    r = ResponsesRenderer("resp_f", "m", 12, None, ResponsesRequest.model_validate({"input": "x"}), (), store)
    r.absorb(event([ContentDelta("Hel")], 1))
    r.failure(APIError("lost", 503))  # a failed stream never reaches done()
    assert store.get("resp_f") is None
    for rid in ("a", "b", "c"):
        store.put({"id": rid}, (), [], [])
        store.get("a")  # used: the oldest unused goes first
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.delete("a") and not store.delete("a") and len(store) == 1


def test_the_store_keeps_to_its_bytes_counting_each_item_with_the_response_that_brought_it():
    store = ResponseStore(10, max_bytes=1000)
    turn = [{"type": "message", "role": "user", "content": "x" * 200}]
    store.put({"id": "a"}, (), turn, [])
    store.put({"id": "b"}, store.get("a").conversation, turn, [])  # a continuation: one new item
    assert store.get("b").size == store.get("a").size < 300  # the earlier item is a's, not b's too
    for rid in "cde":
        store.put({"id": rid}, (), turn, [])
    assert [rid for rid in "abcde" if store.get(rid)] == ["c", "d", "e"]  # 5 × ≈ 250 > 1000: the oldest go
    assert store.bytes == sum(store.get(rid).size for rid in "cde") <= 1000
    store.put({"id": "big"}, (), [{"content": "y" * 5000}], [])  # alone over the budget: kept, alone
    assert len(store) == 1 and store.bytes == store.get("big").size


def test_an_item_reference_is_the_stored_item_it_names():
    store = ResponseStore(4)
    ended(store)
    kept = store.get("resp_1").conversation
    message, call = [item for item in kept if item["type"] in ("message", "function_call")][1:]  # its output
    output = {"type": "function_call_output", "call_id": "call_a", "output": "sunny"}
    body = {"input": [{"role": "user", "content": "Weather?"}, {"type": "item_reference", "id": message["id"]},
                      {"type": "item_reference", "id": call["id"]}, output]}
    resolved = resolve_references(store, ResponsesRequest.model_validate(body), ())
    assert resolved.input == [body["input"][0], message, call, output]
    # as a continuation of the same response they are duplicates, as OpenAI says
    continued = ResponsesRequest.model_validate({"previous_response_id": "resp_1", "input": body["input"][1:]})
    with pytest.raises(APIError) as e:
        resolve_references(store, continued, history(store, continued))
    assert (e.value.status, e.value.param) == (400, "input[0]") and "Duplicate" in e.value.message
    references = ResponsesRequest.model_validate({"input": body["input"][1:]})
    for capacity, param in ((4, "input[0].id"), (0, "input[0]")):  # unknown here; no store at all
        with pytest.raises(APIError) as e:
            resolve_references(ResponseStore(capacity), references, ())
        assert (e.value.status, e.value.param) == (400, param)
    # a response that was given them by reference brings them again: they stay while either is kept
    ended(store, body={"input": resolved.input, "tools": [WEATHER]}, rid="resp_2")
    store.delete("resp_2")
    assert store.item(message["id"]) is message and store.item(call["id"]) is call
    store.delete("resp_1")  # the last response that brought them: they go with it
    assert store.item(message["id"]) is None and store.item(call["id"]) is None


@pytest.mark.parametrize("capacity, code", [(0, None), (4, "previous_response_not_found")])
def test_an_unknown_previous_response_is_a_400_naming_the_field(capacity, code):
    req = ResponsesRequest.model_validate({"input": "x", "previous_response_id": "resp_gone"})
    with pytest.raises(APIError) as e:
        history(ResponseStore(capacity), req)
    assert (e.value.status, e.value.param, e.value.code) == (400, "previous_response_id", code)


# ---- truncation "auto" (prompts.chat_within) ------------------------------------------------------


def test_truncation_drops_the_earliest_whole_turns_that_do_not_fit(tokenizer):
    import asyncio

    from pdserve.frontend.prompts import PromptBuilder, PromptStyle

    builder = PromptBuilder(tokenizer)
    turn = lambda i: [  # noqa: E731 - one turn: a question, a call, its result, the answer
        {"role": "user", "content": f"Question {i}: " + "word " * 40},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}"},
        {"role": "assistant", "content": f"Answer {i}."}]
    system = [{"role": "system", "content": "Be brief."}]
    req = ChatCompletionRequest.model_validate({"messages": system + [m for i in range(5) for m in turn(i)]})

    def length(messages) -> int:
        r = ChatCompletionRequest.model_validate({"messages": messages})
        return len(asyncio.run(builder.chat(r, None, PromptStyle.TEMPLATE)).ids)

    last_two = length(system + turn(3) + turn(4))
    fitted, prompt = asyncio.run(builder.chat_within(req, None, PromptStyle.TEMPLATE, last_two + 10, 10))
    kept = ChatCompletionRequest.model_validate({"messages": system + turn(3) + turn(4)})
    assert fitted.messages == kept.messages
    assert len(prompt.ids) == last_two
    whole, _ = asyncio.run(builder.chat_within(req, None, PromptStyle.TEMPLATE, 100_000, 10))
    assert whole.messages == req.messages  # it fits: nothing dropped
    with pytest.raises(APIError) as e:  # not even the last turn fits
        asyncio.run(builder.chat_within(req, None, PromptStyle.TEMPLATE, length(system + turn(4)) + 9, 10))
    assert (e.value.status, e.value.code) == (400, "context_length_exceeded")
