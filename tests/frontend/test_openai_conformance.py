"""The official `openai` SDK over every parameter the router supports, against `pdserve serve
--mode pd` (the session's server): every answer parses into the SDK's types with the fields
OpenAI's schema requires, streaming aggregates to the non-streaming answer, and every refusal is
an HTTP status the SDK raises as its own exception, even for a streaming request.

Greedy decoding and a few tokens per request keep this quick on two shared CPU cores."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.frontend.router_cases import API_KEY
from tests.served_reference import chat_near_tie

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# every chat parameter the router supports, at once
CHAT_PARAMS = dict(max_completion_tokens=8, temperature=0.7, top_p=0.9, seed=11, presence_penalty=0.1,
                   frequency_penalty=0.1, logit_bias={"28": -1}, logprobs=True, top_logprobs=2, n=2,
                   stop=["\n\n\n"], user="conformance", parallel_tool_calls=True,
                   response_format={"type": "text"})
COMPLETION_PARAMS = dict(max_tokens=6, temperature=0.7, top_p=0.9, seed=11, presence_penalty=0.1,
                         frequency_penalty=0.1, logit_bias={"28": -1}, logprobs=2, n=2, stop=["\n\n\n"],
                         user="conformance", best_of=2)


@pytest.fixture(scope="module")
def client(pd_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module", autouse=True)
def no_traceback_in_the_workers_logs(pd_server):
    """Aborts (sibling choices, stop strings, refusals) are not errors: nothing here may make a
    worker or the router log a traceback."""
    start = pd_server.log_path.stat().st_size
    yield
    with pd_server.log_path.open(encoding="utf-8") as f:
        f.seek(start)
        written = f.read()
    assert "Traceback" not in written and "ClientDisconnect" not in written, written[-4000:]


def messages(text: str = "Name a color.") -> list[dict]:
    return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": text}]


def same_usage(again, first) -> bool:
    """The counts of a repeated request; its prompt may now come from the prefix cache."""
    return again.model_dump(exclude={"prompt_tokens_details"}) == first.model_dump(exclude={"prompt_tokens_details"})


def test_chat_with_every_parameter_streams_what_it_answers(client):
    whole = client.chat.completions.create(model=MODEL, messages=messages(), **CHAT_PARAMS)
    assert whole.object == "chat.completion" and whole.system_fingerprint.startswith("fp_pdserve_")
    assert [c.index for c in whole.choices] == [0, 1]
    for c in whole.choices:
        assert c.message.role == "assistant" and c.message.refusal is None
        assert "refusal" in c.message.model_dump(exclude_unset=True)  # the key is sent, as null
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages(), stream=True,
                                                 stream_options={"include_usage": True}, **CHAT_PARAMS))
    assert chunks[-1].choices == [] and same_usage(chunks[-1].usage, whole.usage)
    for i, c in enumerate(whole.choices):
        mine = [k.choices[0] for k in chunks if k.choices and k.choices[0].index == i]
        assert "".join(d.delta.content or "" for d in mine) == c.message.content
        assert [t.token for d in mine if d.logprobs for t in d.logprobs.content] == \
            [t.token for t in c.logprobs.content]
        assert mine[-1].finish_reason == c.finish_reason
    assert all(k.system_fingerprint == whole.system_fingerprint for k in chunks)


def test_completions_with_every_parameter_stream_what_they_answer(client):
    whole = client.completions.create(model=MODEL, prompt=["Once upon a time", "The sky is"],
                                      **COMPLETION_PARAMS)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    for c in whole.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
    chunks = list(client.completions.create(model=MODEL, prompt=["Once upon a time", "The sky is"], stream=True,
                                            stream_options={"include_usage": True}, **COMPLETION_PARAMS))
    assert chunks[-1].choices == [] and same_usage(chunks[-1].usage, whole.usage)
    for c in whole.choices:
        text = "".join(k.choices[0].text for k in chunks if k.choices and k.choices[0].index == c.index)
        assert text == c.text


def test_continuous_usage_stats_count_the_tokens_in_every_chunk(client):
    """vLLM's stream option: beside include_usage, every chunk's usage is the count so far;
    without it, only the last chunk has one."""
    for create, prompt in ((client.chat.completions.create, {"messages": messages()}),
                           (client.completions.create, {"prompt": "Once upon a time"})):
        for continuous in (True, False):
            chunks = list(create(model=MODEL, max_tokens=6, temperature=0, stream=True, **prompt,
                                 stream_options={"include_usage": True, "continuous_usage_stats": continuous}))
            final = chunks[-1].usage
            assert chunks[-1].choices == [] and final.completion_tokens > 0
            if not continuous:
                assert [k.usage for k in chunks[:-1]] == [None] * (len(chunks) - 1)
                continue
            counts = [k.usage.completion_tokens for k in chunks]
            assert all(k.usage.prompt_tokens == final.prompt_tokens for k in chunks)
            assert counts == sorted(counts) and counts[-1] == final.completion_tokens
            finished = next(k for k in chunks if k.choices and k.choices[0].finish_reason)
            assert finished.usage.completion_tokens == final.completion_tokens
            assert any(k.usage.completion_tokens < final.completion_tokens for k in chunks if k.choices)


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(client):
    """vLLM's extra: the text runs through the stop string it met instead of stopping before it;
    streamed the same. The stop string is taken from the middle of a greedy answer's text."""
    for create, prompt, text_of in (
            (client.chat.completions.create, {"messages": messages("List three colors.")},
             lambda c: c.message.content if hasattr(c, "message") else c.delta.content),
            (client.completions.create, {"prompt": "Once upon a time"}, lambda c: c.text)):
        full = text_of(create(model=MODEL, max_tokens=24, temperature=0, **prompt).choices[0])
        stop = full[len(full) // 2:len(full) // 2 + 3]
        cut = full.index(stop)
        for include in (True, False):
            kwargs = dict(model=MODEL, max_tokens=24, temperature=0, stop=[stop], **prompt,
                          extra_body={"include_stop_str_in_output": include})
            choice = create(**kwargs).choices[0]
            expected = full[:cut + len(stop)] if include else full[:cut]
            assert (text_of(choice), choice.finish_reason) == (expected, "stop"), stop
            streamed = "".join(text_of(k.choices[0]) or "" for k in create(stream=True, **kwargs) if k.choices)
            assert streamed == expected


def test_allowed_token_ids_and_the_stop_reason_as_vllm_has_them(client, tokenizer):
    """Only the allowed tokens are sampled (n choices at a high temperature); `stop_reason` names
    the stop string or the request's stop token that ended a choice, and is null for a length
    cut, streamed or not."""
    words = [tokenizer.encode(w) for w in (" yes", " no", " maybe")]
    assert all(len(ids) == 1 for ids in words)
    allowed = [ids[0] for ids in words]
    r = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=6, temperature=1.5, n=4,
                                  seed=5, logprobs=0, extra_body={"allowed_token_ids": allowed})
    texts = {tokenizer.decode([t]) for t in allowed}
    assert all(set(c.logprobs.tokens) <= texts and len(c.logprobs.tokens) == 6 for c in r.choices)
    assert len({c.text for c in r.choices}) > 1  # they were drawn, not all the same argmax
    assert all(c.stop_reason is None for c in r.choices)  # cut by max_tokens

    # a token and a string from the middle of greedy answers end them
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    ids = tokenizer.encode(full.choices[0].text)
    stop_id = ids[len(ids) // 2]
    answer = client.chat.completions.create(model=MODEL, messages=messages("List three colors."), max_tokens=24,
                                            temperature=0).choices[0].message.content
    stop = answer[len(answer) // 2:len(answer) // 2 + 3]
    for stream in (False, True):
        by_token = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                             stream=stream, extra_body={"stop_token_ids": [stop_id]})
        by_string = client.chat.completions.create(model=MODEL, messages=messages("List three colors."),
                                                   max_tokens=24, temperature=0, stop=[stop], stream=stream)
        last = [list(by_token)[-1], list(by_string)[-1]] if stream else [by_token, by_string]
        assert [(c.choices[0].finish_reason, c.choices[0].stop_reason) for c in last] == [
            ("stop", stop_id), ("stop", stop)]


def test_bad_words_are_never_written(client):
    """vLLM's extra: a word of the greedy answer, banned, is not in the answer then (as a token
    after a space, the way the answer wrote it), and the answer changes from there."""
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=0)
    tokens = client.completions.create(**kwargs).choices[0].logprobs.tokens
    word = next(t for t in tokens[2:] if t.startswith(" ") and t.strip().isalpha())
    banned = client.completions.create(**kwargs, extra_body={"bad_words": [word.strip()]}).choices[0].logprobs.tokens
    assert word not in banned and banned[:tokens.index(word)] == tokens[:tokens.index(word)]


def test_echo_prints_the_prompt_first(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Once upon a time")


def test_tools_answer_with_calls_or_text_consistently(client):
    r = client.chat.completions.create(model=MODEL, messages=messages("What is the weather in Paris?"),
                                       tools=[WEATHER], tool_choice="auto", max_tokens=32, temperature=0)
    choice = r.choices[0]
    assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)
    for call in choice.message.tool_calls or []:
        assert call.type == "function" and call.function.name == "get_weather" and call.id


def test_seeded_sampling_reproduces(client):
    runs = [client.chat.completions.create(model=MODEL, messages=messages(), temperature=1.0, seed=99,
                                           max_tokens=8).choices[0].message.content for _ in range(2)]
    assert runs[0] == runs[1]


def test_sixteen_concurrent_async_streams_match_their_answers(pd_server, client, default_model_dir, tokenizer):
    """Each answer is the prompt's answer alone, or parts from it only at a near-tie of the served
    model ("Say hello." has one: tests/served_reference.py)."""
    prompts = ["Say hello.", "Name a color.", "Count to three.", "Name a fruit."]
    expected = {p: client.chat.completions.create(model=MODEL, messages=messages(p), max_tokens=8,
                                                  temperature=0).choices[0].message.content for p in prompts}

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, str]:
        stream = await aclient.chat.completions.create(model=MODEL, messages=messages(prompt), max_tokens=8,
                                                       temperature=0, stream=True)
        return prompt, "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run_all() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=300) as a:
            return await asyncio.gather(*(one(a, prompts[i % 4]) for i in range(16)))

    for prompt, text in asyncio.run(run_all()):
        assert text == expected[prompt] or chat_near_tie(default_model_dir, tokenizer, messages(prompt), text,
                                                         expected[prompt]), (prompt, text, expected[prompt])


# ---- refusals are HTTP statuses, streaming or not ------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_empty_prompt_is_a_400_even_when_streaming(client, stream):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="", max_tokens=4, stream=stream)
    assert e.value.status_code == 400 and e.value.body["param"] == "prompt"


@pytest.mark.parametrize("stream", [False, True])
def test_over_the_context_is_a_400_with_the_numbers_within_half_a_second(client, stream):
    limit = client.models.list().data[0].model_extra["max_model_len"]
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages(), max_tokens=limit, stream=stream)
    assert time.monotonic() - started < 0.5
    assert e.value.body["code"] == "context_length_exceeded"
    assert f"maximum context length is {limit} tokens" in e.value.body["message"]


def test_tokenize_counts_what_a_chat_request_is_billed(pd_server, client):
    r = client.chat.completions.create(model=MODEL, messages=messages(), max_tokens=2, temperature=0)
    counted = httpx.post(f"{pd_server.url}/tokenize", json={"messages": messages()}, timeout=10).json()
    assert counted["count"] == r.usage.prompt_tokens
