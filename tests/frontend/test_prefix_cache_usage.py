"""`usage.prompt_tokens_details.cached_tokens` end to end through `pdserve serve --mode pd`: a
repeated prompt reports all but its last token as cached — its full KV blocks and the first
tokens of its last one, kept as a tail — or, when the prompt ends a block exactly, all but that
block (the prefill worker's hits, carried by the KV transfer to the decode worker and by its
last line to the router), streamed or not."""
from __future__ import annotations

import re
import uuid

import httpx
import openai
import pytest

from pdserve.tokenizer import Tokenizer
from tests.frontend.router_cases import API_KEY
from tests.served_reference import chat_near_tie

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16  # the workers' default block size


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^pdserve:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


def test_a_repeated_prompt_reports_what_it_reused_as_cached(pd_server, default_model_dir, tokenizer):
    client = openai.OpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    # a prompt no other test sends: nothing of it is cached before the first call
    system = f"Session {uuid.uuid4().hex}. " + "You answer in one short sentence. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a color."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 3 * BLOCK
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # its first block names the session
    # the last token is computed (its logits); a full cached block is shared, never written
    reused = n - 1 if n % BLOCK else n - BLOCK
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == reused
    # the repeat computes only the last token: its answer may part from the first at a near-tie
    ours, whole = again.choices[0].message.content, first.choices[0].message.content
    assert ours == whole or chat_near_tie(default_model_dir, tokenizer, messages, ours, whole), (ours, whole)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == reused


def test_a_cache_salt_reuses_only_what_its_own_salt_left(pd_server):
    """vLLM's cache_salt, through the router and both PD workers: a repeat under the same salt
    reuses the prompt as an unsalted repeat would; under another salt or none, nothing. The
    Responses API takes it too."""
    client = openai.OpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    system = f"Tenant {uuid.uuid4().hex}. " + "You answer in one short sentence. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                             extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                           extra_body={"cache_salt": "tenant-a"})
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-a") == (n - 1 if n % BLOCK else n - BLOCK)
    response = client.responses.create(model=MODEL, input=messages, max_output_tokens=3, temperature=0,
                                       store=False, extra_body={"cache_salt": "tenant-a"})
    assert response.usage.input_tokens == n
    assert response.usage.input_tokens_details.cached_tokens == (n - 1 if n % BLOCK else n - BLOCK)


def test_reset_prefix_cache_forgets_what_every_worker_cached(pd_server):
    """POST /reset_prefix_cache (vLLM's; it needs the API key): both workers forget their caches,
    so a prompt that was cached is computed whole again, with the same answer; the router's kept
    tokenizations go too."""
    client = openai.OpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    system = f"Reset {uuid.uuid4().hex}. " + "You answer in one short sentence. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a tree."}]

    def ask():
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)

    first = ask()
    reused = metric(pd_server.url, "tokenizer_reused_tokens_total")
    assert ask().usage.prompt_tokens_details.cached_tokens > 0
    assert metric(pd_server.url, "tokenizer_reused_tokens_total") > reused  # the router's tokenization too
    refused = httpx.post(pd_server.url + "/reset_prefix_cache", timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(pd_server.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ok"] and sorted(w["role"] for w in body["workers"]) == ["decode", "prefill"]
    assert all(w["forgotten_blocks"] > 0 for w in body["workers"])
    reused = metric(pd_server.url, "tokenizer_reused_tokens_total")
    after = ask()
    assert after.usage.prompt_tokens_details.cached_tokens == 0
    assert metric(pd_server.url, "tokenizer_reused_tokens_total") == reused
    assert after.choices[0].message.content == first.choices[0].message.content


def test_a_later_turn_reuses_the_routers_tokenization_of_the_last(pd_server, default_model_dir):
    """The router tokenizes a conversation's next turn after what it kept of the last one
    (frontend/prompt_prefixes.py): the ids equal a whole tokenization of the rendered prompt, and
    its counter grows by the last prompt up to the `<|im_start|>` that opened the answer."""
    tok = Tokenizer(default_model_dir)
    client = openai.OpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    messages = [{"role": "system", "content": f"Agent {uuid.uuid4().hex}. " + "Use the tools. " * 40},
                {"role": "user", "content": "List the files."}]

    def turn() -> list[int]:
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                             extra_body={"return_token_ids": True})
        messages.append({"role": "assistant", "content": out.choices[0].message.content})
        return out.prompt_token_ids

    first = turn()
    assert first == tok.encode(tok.apply_chat_template(messages[:-1], add_generation_prompt=True))
    messages.append({"role": "user", "content": "Now read the first one, naïvely 😀."})
    before = metric(pd_server.url, "tokenizer_reused_tokens_total")
    second = turn()
    assert second == tok.encode(tok.apply_chat_template(messages[:-1], add_generation_prompt=True))
    opened = len(first) - len(tok.encode("assistant\n"))  # the ids through the answer's <|im_start|>
    assert metric(pd_server.url, "tokenizer_reused_tokens_total") - before == opened
    assert second[:opened] == first[:opened]


def test_a_text_completions_next_prompt_reuses_the_routers_tokenization(pd_server, default_model_dir):
    """/v1/completions with an agent's own ChatML text: the next prompt (the last plus the answer
    and a new turn) tokenizes after the last one's last special token; the ids equal a whole
    tokenization with the tokenizer's special tokens, and the counter grows by the reused ids."""
    tok = Tokenizer(default_model_dir)
    client = openai.OpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    prompt = (f"<|im_start|>system\nAgent {uuid.uuid4().hex}. " + "Use the tools. " * 40
              + "<|im_end|>\n<|im_start|>user\nList the files.<|im_end|>\n<|im_start|>assistant\n")

    def turn(text: str) -> tuple[list[int], str]:
        out = client.completions.create(model=MODEL, prompt=text, max_tokens=4, temperature=0,
                                        extra_body={"return_token_ids": True})
        return out.choices[0].prompt_token_ids, out.choices[0].text

    first, answer = turn(prompt)
    assert first == tok.encode(prompt, add_special_tokens=True)
    prompt += answer + "<|im_end|>\n<|im_start|>user\nNow read the first one.<|im_end|>\n<|im_start|>assistant\n"
    before = metric(pd_server.url, "tokenizer_reused_tokens_total")
    second, _ = turn(prompt)
    assert second == tok.encode(prompt, add_special_tokens=True)
    opened = len(first) - len(tok.encode("assistant\n"))  # the ids through the answer's <|im_start|>
    assert metric(pd_server.url, "tokenizer_reused_tokens_total") - before == opened
