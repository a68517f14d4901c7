"""OpenAI conformance at the router's edge, in process, with no worker behind it: what the
schema allows is accepted (it gets as far as the 503 for no worker), what it forbids is a 400
naming the field, and the vLLM-style utility endpoints work without any worker."""
from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from pdserve.frontend.app import create_app
from pdserve.frontend.render import version

from tests.frontend.conftest import router_config
from tests.frontend.router_cases import API_KEY, CHAT, COMPLETIONS, chat, completion

AUTH = {"Authorization": f"Bearer {API_KEY}"}
NO_WORKER = 503  # a body the router accepted meets the empty pool


@pytest.fixture(scope="module")
def client(default_model_dir):
    from pdserve.tokenizer import Tokenizer

    config = router_config(default_model_dir, max_request_bytes=8 << 20)
    with TestClient(create_app(config, Tokenizer(default_model_dir))) as c:
        yield c


@pytest.mark.parametrize("path,body", [
    (CHAT, chat(n=None, stream=None, logprobs=None, temperature=None, top_p=None, stop=None,
                presence_penalty=None, frequency_penalty=None, seed=None, max_tokens=None,
                max_completion_tokens=None, top_logprobs=None, user=None, logit_bias=None,
                tools=None, tool_choice=None, parallel_tool_calls=None, stream_options=None,
                response_format=None)),
    (COMPLETIONS, completion(n=None, stream=None, echo=None, logprobs=None, best_of=None, suffix=None,
                             temperature=None, top_p=None, stop=None, seed=None, max_tokens=None,
                             presence_penalty=None, frequency_penalty=None, logit_bias=None, user=None)),
], ids=["chat", "completions"])
def test_null_means_the_default_for_every_nullable_field(client, path, body):
    r = client.post(path, json=body, headers=AUTH)
    assert r.status_code == NO_WORKER, r.json()


def test_deprecated_function_role_is_accepted(client):
    messages = [{"role": "user", "content": "What is the weather?"},
                {"role": "assistant", "content": None,
                 "function_call": {"name": "weather", "arguments": "{}"}},
                {"role": "function", "name": "weather", "content": "sunny"}]
    r = client.post(CHAT, json=chat(messages=messages), headers=AUTH)
    assert r.status_code == NO_WORKER, r.json()


@pytest.mark.parametrize("stream", [False, True])
def test_empty_completion_prompt_is_a_400_naming_prompt(client, stream):
    r = client.post(COMPLETIONS, json=completion(prompt="", stream=stream), headers=AUTH)
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"] == "prompt must not be empty"


def test_405_names_the_allowed_methods(client):
    r = client.get(CHAT, headers=AUTH)
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    assert set(r.json()) == {"error"}


@pytest.mark.parametrize("path,param,make", [
    (CHAT, "messages", lambda text: chat(messages=[{"role": "user", "content": text}])),
    (COMPLETIONS, "prompt", lambda text: completion(prompt=text)),
], ids=["chat", "completions"])
def test_a_text_too_big_to_fit_is_refused_untokenized_within_half_a_second(client, path, param, make):
    body = make("word " * 1_200_000)  # 6 MB: a lower bound from its size alone is over the context
    started = time.monotonic()
    r = client.post(path, json=body, headers=AUTH)
    took = time.monotonic() - started
    assert r.status_code == 400, r.json()
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param
    assert "maximum context length is 8192 tokens" in err["message"] and "at least" in err["message"]
    assert took < 0.5 + 0.5, took  # the body's upload and JSON parse included (two shared cores)


def test_prompt_plus_max_tokens_over_the_context_names_the_numbers(client, tokenizer):
    prompt = "hello " * 100
    n = len(tokenizer.encode(prompt, add_special_tokens=True))
    r = client.post(COMPLETIONS, json=completion(prompt=prompt, max_tokens=8193 - n), headers=AUTH)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "maximum context length is 8192 tokens" in msg and f"requested 8193 tokens ({n} in the prompt" in msg


# ---- /tokenize, /detokenize, /version ----------------------------------------------------------


def test_tokenize_a_prompt_adds_special_tokens_like_completions(client, tokenizer):
    r = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer.encode("Hello world", add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 8192
    assert "".join(body["token_strs"]) == "Hello world"


def test_tokenize_messages_applies_the_chat_template(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.post("/tokenize", json={"messages": messages})
    expected = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert r.status_code == 200 and r.json()["tokens"] == expected
    text = client.post("/detokenize", json={"tokens": expected}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_tokenize_needs_exactly_one_input(client):
    r = client.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert r.status_code == 400 and "exactly one of prompt and messages" in r.json()["error"]["message"]


def test_detokenize_refuses_ids_outside_the_vocabulary(client):
    r = client.post("/detokenize", json={"tokens": [1, 10**8]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_version(client):
    r = client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": version()}


@pytest.mark.parametrize("fields", [{"top_p": 0}, {"temperature": 1e-300}, {"temperature": 5e-324, "top_p": 0.5}])
def test_top_p_zero_and_vanishing_temperatures_sample_greedily(fields):
    """Both are schema-valid; 1e-300 would overflow the logits' division in the sampler."""
    from pdserve.frontend.protocol import ChatCompletionRequest
    from pdserve.frontend.requests import sampling_params

    req = ChatCompletionRequest.model_validate(chat(**fields))
    params = sampling_params(req, 4, None, 1000)
    assert (params.temperature, params.top_p) == (0.0, 1.0)


def test_a_null_completion_prompt_starts_a_new_document(client):
    r = client.post(COMPLETIONS, json=completion(prompt=None), headers=AUTH)
    assert r.status_code == NO_WORKER, r.json()


def test_a_prompt_no_workers_pool_holds_is_a_400_before_any_work(client):
    """A worker's context is reconciled with its pool at start, but a router may be told a larger
    --max-model-len: the prompt is still checked against the smallest pool the workers report."""
    from pdserve.worker_api import Info

    worker = client.app.state.router.pool.workers[0]
    saved = worker.info
    worker.info = Info(role=worker.role, worker_id="w", model="m", max_model_len=8192, block_size=16,
                       num_blocks=64, tp=1, eos_token_ids=[])
    try:
        r = client.post(COMPLETIONS, json=completion(prompt=[28] * 1100), headers=AUTH)
    finally:
        worker.info = saved
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert err["message"].startswith("The prompt has 1100 tokens; the workers' KV cache holds 1024.")
