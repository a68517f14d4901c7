"""`pdserve serve --mode pd` end to end with the official openai client (one server per session).

Greedy decoding and a few tokens per request keep this quick on two shared CPU cores."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from pdserve.frontend.app import create_app

from tests.frontend.conftest import SERVE_MAX_BODY, router_config
from tests.frontend.router_cases import API_KEY, CHAT, bad_input_cases, check_error
from tests.served_reference import chat_near_tie

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["Say hello.", "What is the capital of France?", "Count to five.", "Name a color."]


@pytest.fixture(scope="module")
def client(pd_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=120)


def ask(client, prompt: str, **kw):
    kw = {"max_tokens": 12, "temperature": 0, **kw}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kw)


def load_is_idle(url: str) -> bool:
    load = httpx.get(f"{url}/load", timeout=5).json()
    return (load["waiting"] == load["running"] == load["transferring"] == 0
            and load["free_blocks"] == load["total_blocks"])


def wait_idle(server, timeout_s: float = 10.0) -> None:
    workers = server.workers()
    deadline = time.monotonic() + timeout_s
    while not all(load_is_idle(u) for u in workers.values()):
        assert time.monotonic() < deadline, {r: httpx.get(f"{u}/load").json() for r, u in workers.items()}
        time.sleep(0.1)


def test_chat_non_streaming(client):
    r = ask(client, PROMPTS[0])
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.model == MODEL and r.id.startswith("chatcmpl-")
    assert 0 < r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client):
    whole = ask(client, PROMPTS[1]).choices[0]
    chunks = list(ask(client, PROMPTS[1], stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert all(c.usage is None for c in chunks)


def test_usage_chunk_comes_last_with_no_choices(client):
    chunks = list(ask(client, PROMPTS[2], stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert 1 <= last.usage.completion_tokens <= 12 and last.usage.prompt_tokens > 10
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_ids_and_lists(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.choices[0].text and r.choices[0].finish_reason in ("stop", "length")
    ids = tokenizer.encode("The capital of France is")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    many = client.completions.create(model=MODEL, prompt=["One, two,", "A, B,"], max_tokens=4, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.usage.prompt_tokens == len(tokenizer.encode("One, two,")) + len(tokenizer.encode("A, B,"))


def test_completions_echo_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Once upon a time")
    lp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                   logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)


def test_chat_logprobs(client):
    r = ask(client, PROMPTS[3], max_tokens=4, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_n_2_gives_two_choices(client):
    r = ask(client, PROMPTS[0], n=2, temperature=0.9, seed=7, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 16
    assert all(c.message.content for c in r.choices)
    streamed = list(ask(client, PROMPTS[0], n=2, temperature=0.9, seed=7, max_tokens=8, stream=True))
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i)
        assert text == r.choices[i].message.content


def test_stop_string_cuts_the_output_and_frees_the_room(client, pd_server):
    full = ask(client, PROMPTS[1], max_tokens=16).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    r = ask(client, PROMPTS[1], max_tokens=16, stop=[stop, "never-appears"])
    assert r.choices[0].message.content == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    wait_idle(pd_server)


def test_seed_reproducibility(client):
    runs = [ask(client, PROMPTS[3], temperature=1.0, seed=1234, max_tokens=10).choices[0].message.content
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_64_concurrent_streams_all_complete_correctly(pd_server, default_model_dir, tokenizer):
    """Each answer among 64 streams is the same prompt's answer alone, or parts from it only at a
    near-tie of the served model (tests/served_reference.py)."""
    sync = openai.OpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    expected = {p: ask(sync, p, max_tokens=8).choices[0].message.content for p in PROMPTS}

    async def one(aclient, prompt):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0,
            stream=True)
        parts, finish = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return prompt, "".join(parts), finish

    async def run_all():
        async with openai.AsyncOpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, PROMPTS[i % 4]) for i in range(64)))

    results = asyncio.run(run_all())
    assert len(results) == 64
    for prompt, text, finish in results:
        assert finish in ("stop", "length")
        user = [{"role": "user", "content": prompt}]
        assert text == expected[prompt] or chat_near_tie(default_model_dir, tokenizer, user, text,
                                                         expected[prompt]), (prompt, text, expected[prompt])
    wait_idle(pd_server)


def test_bad_input_matrix_then_a_normal_request(pd_server):
    cases = bad_input_cases(SERVE_MAX_BODY)
    assert len(cases) >= 25
    ok_body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
               "temperature": 0}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=pd_server.url, timeout=60) as http:
        for case in cases:
            r = http.request(case.method, case.path, **case.request_kwargs())
            check_error(r.status_code, r.json(), case)
            ok = http.post(CHAT, json=ok_body, headers=auth)
            assert ok.status_code == 200, (case.name, ok.text)
            assert ok.json()["choices"][0]["message"]["content"] is not None


def test_client_disconnect_mid_stream_aborts_the_room(pd_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "disconnect-test"}
    with httpx.Client(base_url=pd_server.url, timeout=60) as http:
        with http.stream("POST", CHAT, json=body, headers=headers) as r:
            assert r.status_code == 200 and r.headers["x-request-id"] == "disconnect-test"
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 4:
                    break
        # leaving the block closed the connection mid-stream
    decode = pd_server.workers()["decode"]
    load = httpx.get(f"{decode}/load", timeout=5).json()
    wait_idle(pd_server, timeout_s=5)
    assert load["total_blocks"] > 0


def test_models_health_and_metrics(pd_server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{pd_server.url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{pd_server.url}/ready", timeout=5).status_code == 200
    text = httpx.get(f"{pd_server.url}/metrics", timeout=5).text
    for name in ("pdserve:request_success_total", "pdserve:generation_tokens_total",
                 "pdserve:time_to_first_token_seconds_bucket", "pdserve:aborts_total",
                 "pdserve:e2e_request_latency_seconds_count"):
        assert name in text


def _sse_payloads(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            out.append(json.loads(block[6:]))
    return out


def test_stream_batching_gives_identical_output_at_every_n(pd_server, default_model_dir, tokenizer):
    """Routers with --stream-batch 1..8 in this process, in front of the same workers."""
    workers = pd_server.workers()
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 20,
            "temperature": 0, "stream": True, "logprobs": True, "stop": ["never-appears"]}

    async def run(n: int) -> tuple[str, list[int]]:
        config = router_config(default_model_dir, prefill_urls=[workers["prefill"]],
                               decode_urls=[workers["decode"]], stream_batch=n, api_key=None)
        app = create_app(config, tokenizer)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                         timeout=120) as http:
                r = await http.post(CHAT, json=body)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        chunks = [c for c in _sse_payloads(r.text) if c["choices"]]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        sizes = [len(c["choices"][0]["logprobs"]["content"]) for c in chunks[1:]]
        return text, sizes

    results = {n: asyncio.run(run(n)) for n in range(1, 9)}
    assert len({text for text, _ in results.values()}) == 1, results
    for n, (_, sizes) in results.items():
        assert max(sizes) <= n and sizes[0] == 1, (n, sizes)
        if n > 1 and sum(sizes) > 2:
            assert max(sizes) > 1, (n, sizes)
