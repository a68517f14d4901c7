"""The Responses API through `pdserve serve` (PD) and the official `openai` SDK: a response is the
chat completion of the same conversation (greedy, token for token, the same usage), streamed or
not; the SDK's stream helper, which checks every event against the items it opened, rebuilds the
same response; a forced function call comes back as a `function_call` item, and sending it with
its output continues the conversation exactly as the chat messages of that turn would, and so
do continuing the stored response with `previous_response_id` and naming its calls by
`item_reference`; a JSON schema in `text.format`
holds; stored responses are retrieved, deleted, and never kept with `store: false`."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.frontend.router_cases import API_KEY, WEATHER

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

MODEL = "SmolLM2-135M-Instruct"
STRICT_WEATHER = {**WEATHER, "strict": True,
                  "parameters": {**WEATHER["parameters"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in STRICT_WEATHER.items() if k != "type"}}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(pd_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.mark.parametrize("limit, status", [(6, "incomplete"), (80, "completed")])
def test_a_response_is_the_chat_completion_of_the_same_conversation(client, limit, status):
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="Say hi", max_output_tokens=limit,
                                temperature=0)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Say hi"}],
                                       max_tokens=limit, temperature=0)
    assert c.choices[0].finish_reason == ("length" if status == "incomplete" else "stop")
    assert r.status == status and r.id.startswith("resp_") and r.object == "response"
    assert r.incomplete_details == (None if status == "completed" else
                                    openai.types.responses.response.IncompleteDetails(reason="max_output_tokens"))
    [message] = r.output
    assert message.type == "message" and message.status == status and message.role == "assistant"
    assert r.output_text == c.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.total_tokens == c.usage.total_tokens


def test_a_streamed_response_is_the_same_response(client):
    whole = client.responses.create(model=MODEL, input="Say hi", max_output_tokens=40, temperature=0)
    # as Codex asks: nothing stored, reasoning's encrypted content included (there is none)
    with client.responses.stream(model=MODEL, input="Say hi", max_output_tokens=40, temperature=0, store=False,
                                 include=["reasoning.encrypted_content"]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == final.output_text == whole.output_text and len(deltas) > 1
    assert final.id == events[0].response.id and final.status == whole.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_logprobs_are_the_chat_completions_logprobs_of_the_same_tokens(client):
    """`include: ["message.output_text.logprobs"]`: the text's tokens, each with its logprob and
    `top_logprobs` alternatives, as chat completions give them for the same greedy answer
    (this model has no reasoning or call markup, so every output token but the end of turn is
    text; logprobs agree to a few 1e-4: the two prompts ran in differently shaped steps);
    streamed, the deltas carry the same ones."""
    include = ["message.output_text.logprobs"]
    r = client.responses.create(model=MODEL, input="Name three colors.", max_output_tokens=30, temperature=0,
                                include=include, top_logprobs=2)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name three colors."}],
                                       max_tokens=30, temperature=0, logprobs=True, top_logprobs=2)
    [part] = r.output[0].content
    *expected, end = c.choices[0].logprobs.content
    assert c.choices[0].finish_reason == "stop" and end.token == "<|im_end|>"  # a marker: not the text's
    assert part.text == c.choices[0].message.content and len(part.logprobs) == len(expected) > 5
    assert b"".join(bytes(lp.bytes) for lp in part.logprobs).decode() == part.text
    for ours, theirs in zip(part.logprobs, expected):
        assert (ours.token, ours.bytes) == (theirs.token, theirs.bytes)
        assert ours.logprob == pytest.approx(theirs.logprob, abs=5e-3)
        assert [t.token for t in ours.top_logprobs] == [t.token for t in theirs.top_logprobs]
        assert [t.logprob for t in ours.top_logprobs] == pytest.approx([t.logprob for t in theirs.top_logprobs],
                                                                      abs=5e-3)
    assert r.top_logprobs == 2
    with client.responses.stream(model=MODEL, input="Name three colors.", max_output_tokens=30, temperature=0,
                                 include=include, top_logprobs=2) as stream:
        events = list(stream)
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in part.logprobs], abs=5e-3)
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in part.logprobs]
    plain = client.responses.create(model=MODEL, input="Name three colors.", max_output_tokens=30, temperature=0,
                                    top_logprobs=2)  # alternatives without the include: none, as OpenAI's
    assert plain.output[0].content[0].logprobs == []


def test_the_stream_is_typed_events_with_no_done_marker(pd_server):
    body = {"model": MODEL, "input": "Say hi", "max_output_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{pd_server.v1}/responses", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    for block in blocks:
        name, data = block.split("\n")
        assert name == f"event: {json.loads(data.removeprefix('data: '))['type']}"
    assert blocks[-1].startswith("event: response.incomplete\n")  # 8 tokens: cut by max_output_tokens


def test_a_function_call_and_its_output_continue_the_conversation_as_chat_does(client):
    r = client.responses.create(model=MODEL, input=QUESTION, tools=[STRICT_WEATHER], tool_choice="required",
                                max_output_tokens=60, temperature=0)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                       tools=[CHAT_WEATHER], tool_choice="required", max_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and all(o.status == "completed" for o in calls)
    assert [(o.name, o.arguments) for o in calls] == [(t.function.name, t.function.arguments)
                                                      for t in c.choices[0].message.tool_calls]
    assert "city" in json.loads(calls[0].arguments)

    outputs = [{"type": "function_call_output", "call_id": o.call_id, "output": "Sunny, 21 C"} for o in calls]
    after = client.responses.create(model=MODEL, input=[{"role": "user", "content": QUESTION},
                                                        *[o.to_dict() for o in calls], *outputs],
                                    tools=[STRICT_WEATHER], max_output_tokens=40, temperature=0)
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": o.call_id, "type": "function", "function": {"name": o.name, "arguments": o.arguments}}
                    for o in calls]},
                *[{"role": "tool", "tool_call_id": o["call_id"], "content": o["output"]} for o in outputs]]
    chat_after = client.chat.completions.create(model=MODEL, messages=messages, tools=[CHAT_WEATHER], max_tokens=40,
                                                temperature=0)
    assert after.usage.input_tokens == chat_after.usage.prompt_tokens
    assert after.output_text == chat_after.choices[0].message.content and after.output_text
    # the same turn as a continuation of the stored response: only the outputs are sent
    continued = client.responses.create(model=MODEL, previous_response_id=r.id, input=outputs, tools=[STRICT_WEATHER],
                                        max_output_tokens=40, temperature=0)
    assert continued.previous_response_id == r.id
    assert (continued.usage.input_tokens, continued.output_text) == (after.usage.input_tokens, after.output_text)
    # ... and with the calls named by reference, as the AI SDK sends stored items
    referenced = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": QUESTION}, *[{"type": "item_reference", "id": o.id} for o in calls], *outputs],
        tools=[STRICT_WEATHER], max_output_tokens=40, temperature=0)
    assert (referenced.usage.input_tokens, referenced.output_text) == (after.usage.input_tokens, after.output_text)

    with client.responses.stream(model=MODEL, input=QUESTION, tools=[STRICT_WEATHER], tool_choice="required",
                                 max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert [(o.name, o.arguments) for o in final.output] == [(o.name, o.arguments) for o in calls]
    assert args == "".join(o.arguments for o in calls)


def test_a_json_schema_format_holds(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Describe a person.", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed"
    value = json.loads(r.output_text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_a_continued_response_is_the_response_to_the_whole_conversation(client):
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="My name is Ada. Say hi.",
                                    max_output_tokens=80, temperature=0)
    assert first.store is True and client.responses.retrieve(first.id).model_dump() == first.model_dump()
    with client.responses.stream(model=MODEL, instructions="Be brief.", previous_response_id=first.id,
                                 input="What is my name?", max_output_tokens=80, temperature=0) as stream:
        second = stream.get_final_response()
    # stateless: the whole conversation sent again, the earlier output items as they came back
    whole = client.responses.create(model=MODEL, instructions="Be brief.", input=[
        {"role": "user", "content": "My name is Ada. Say hi."}, *[o.to_dict() for o in first.output],
        {"role": "user", "content": "What is my name?"}], max_output_tokens=80, temperature=0, store=False)
    assert second.status == whole.status == "completed"  # the stream helper's final response needs it
    assert second.previous_response_id == first.id and second.output_text == whole.output_text
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    kept = client.responses.retrieve(second.id)  # (the helper's final response is a ParsedResponse)
    assert (kept.output_text, kept.usage, kept.previous_response_id) == (second.output_text, second.usage, first.id)
    # what it was given: the first turn (its input, its answer) and its own input, newest first
    given = list(client.responses.input_items.list(second.id))
    assert [(i.type, i.role) for i in given] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert given[1].id == first.output[0].id and all(i.id for i in given)
    assert [(c.type, c.text) for c in given[0].content] == [("input_text", "What is my name?")]
    page = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.id for i in page.data] == [i.id for i in reversed(given)][:2] and page.has_more
    rest = client.responses.input_items.list(second.id, order="asc", limit=2, after=page.data[-1].id)
    assert [i.id for i in rest.data] == [given[0].id] and not rest.has_more

    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client.responses.retrieve(whole.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(first.id)
    assert gone.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="Again?", max_output_tokens=4)
    assert (e.value.code, e.value.param) == ("previous_response_not_found", "previous_response_id")
    # the chain after it lives on: each response keeps its whole conversation
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks.",
                                    max_output_tokens=4, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens


def test_truncation_auto_drops_the_earliest_turns_that_do_not_fit(client, pd_server):
    filler = "word " * 3000  # ≈ 3,000 tokens: three such turns are over the 8,192-token context
    turns = [m for i in range(3) for m in ({"role": "user", "content": f"Part {i}. {filler}"},
                                           {"role": "assistant", "content": f"Noted {i}."})]
    turns.append({"role": "user", "content": "Say hi."})
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=turns, max_output_tokens=8)
    assert e.value.code == "context_length_exceeded"
    r = client.responses.create(model=MODEL, input=turns, max_output_tokens=8, temperature=0, truncation="auto")
    kept = httpx.post(f"{pd_server.url}/tokenize", json={"model": MODEL, "messages": turns[2:]}, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert r.truncation == "auto" and r.usage.input_tokens == kept["count"]  # the first turn went, whole
