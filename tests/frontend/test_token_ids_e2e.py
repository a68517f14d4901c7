"""vLLM's `return_token_ids` through `pdserve serve` (PD): the answer carries the prompt's token
ids (what /tokenize counts for the same request) and every token each choice sampled (they
spell its text, the end of turn included), streamed or not; a stream's chunks carry the same ids
as the whole answer, the prompt's only once."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.frontend.router_cases import API_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Say hi"}]


def chunks(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_a_chat_answer_carries_its_prompt_and_output_token_ids(pd_server, tokenizer):
    body = {"messages": MESSAGES, "max_tokens": 80, "temperature": 0, "n": 2, "return_token_ids": True}
    whole = httpx.post(f"{pd_server.v1}/chat/completions", json=body, headers=AUTH, timeout=120).json()
    counted = httpx.post(f"{pd_server.url}/tokenize", json={"messages": MESSAGES}, timeout=10).json()
    assert whole["prompt_token_ids"] == counted["tokens"] and len(counted["tokens"]) == whole["usage"]["prompt_tokens"]
    for choice in whole["choices"]:
        ids = choice["token_ids"]
        assert choice["finish_reason"] == "stop" and ids[-1] == tokenizer.token_to_id("<|im_end|>")
        assert tokenizer.decode(ids[:-1]) == choice["message"]["content"]
    assert sum(len(c["token_ids"]) for c in whole["choices"]) == whole["usage"]["completion_tokens"]
    streamed = chunks(f"{pd_server.v1}/chat/completions", body)
    assert [c["prompt_token_ids"] for c in streamed if "prompt_token_ids" in c] == [whole["prompt_token_ids"]]
    for i, choice in enumerate(whole["choices"]):
        got = [t for c in streamed for e in c["choices"] if e["index"] == i for t in e.get("token_ids") or []]
        assert got == choice["token_ids"]
    plain = httpx.post(f"{pd_server.v1}/chat/completions", json={**body, "return_token_ids": False}, headers=AUTH,
                       timeout=120).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_a_completion_answer_carries_each_prompts_token_ids(pd_server, tokenizer):
    prompts = ["The capital of France is", "Two plus two is"]
    body = {"prompt": prompts, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    whole = httpx.post(f"{pd_server.v1}/completions", json=body, headers=AUTH, timeout=120).json()
    for choice, prompt in zip(whole["choices"], prompts):
        assert choice["prompt_token_ids"] == tokenizer.encode(prompt)
        assert len(choice["token_ids"]) == 8 and tokenizer.decode(choice["token_ids"]) == choice["text"]
    streamed = chunks(f"{pd_server.v1}/completions", body)
    for choice in whole["choices"]:
        entries = [e for c in streamed for e in c["choices"] if e["index"] == choice["index"]]
        assert [e["prompt_token_ids"] for e in entries if "prompt_token_ids" in e] == [choice["prompt_token_ids"]]
        assert [t for e in entries for t in e["token_ids"]] == choice["token_ids"]


def text_of(url: str, body: dict, stream: bool) -> str:
    if stream:
        return "".join(e.get("text") or "" for c in chunks(url, body) for e in c["choices"])
    return httpx.post(url, json=body, headers=AUTH, timeout=120).json()["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_text_leaves_the_ending_stop_token_out_and_shows_special_tokens_when_asked(pd_server, tokenizer,
                                                                                      stream):
    """vLLM's rules for the text: the stop_token_ids entry that ended a completion is not text
    unless `include_stop_str_in_output`; with `skip_special_tokens: false` special tokens are (EOS
    sampled under ignore_eos), but not the EOS that ended a chat answer."""
    url = f"{pd_server.v1}/completions"
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    ids = httpx.post(url, json=body, headers=AUTH, timeout=120).json()["choices"][0]["token_ids"]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and tokenizer.decode([ids[i]]).strip())
    for include in (False, True):
        text = text_of(url, {**body, "stop_token_ids": [ids[k]], "include_stop_str_in_output": include}, stream)
        assert text == tokenizer.decode(ids[:k + include])

    eos = tokenizer.eos_token_id
    forced = {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {str(eos): 100}}
    assert text_of(url, forced, stream) == ""
    assert text_of(url, {**forced, "skip_special_tokens": False}, stream) == tokenizer.decode([eos]) * 3

    chat = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0}
    answers = [httpx.post(f"{pd_server.v1}/chat/completions", json={**chat, "skip_special_tokens": skip},
                          headers=AUTH, timeout=120).json()["choices"][0] for skip in (True, False)]
    assert answers[0]["finish_reason"] == "stop" and answers[0]["message"] == answers[1]["message"]
