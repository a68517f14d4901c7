"""`--local-prefill-tokens` end to end (`pdserve serve --mode pd --local-prefill-tokens 64`). A
conversation's first turn goes through the prefill worker. Its next turn, of which the decode
worker holds all but a few tokens, goes to the decode worker alone: the prefill worker sees nothing
of it, the router counts it, the decode worker reuses the first turn's blocks, and the answer is
the plain PD server's. A local stream that its client leaves gives its blocks back."""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.frontend.conftest import Server, start_server, stop_server
from tests.frontend.router_cases import API_KEY
from tests.frontend.test_router_e2e import wait_idle
from tests.frontend.test_routing_e2e import counter
from tests.served_reference import chat_near_tie

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16
LOCAL = 64


@pytest.fixture(scope="module")
def local_pd() -> Iterator[Server]:
    server = start_server("--mode", "pd", "--local-prefill-tokens", str(LOCAL))
    yield server
    stop_server(server.proc)


def metric(url: str, name: str) -> float:
    return counter(httpx.get(f"{url}/metrics", timeout=10).text, name)


def lookups_after(url: str, before: float) -> float:
    """The worker's prompt tokens looked up in its prefix cache, once more than `before` (a worker
    publishes its counts once idle, just after an answer)."""
    deadline = time.monotonic() + 30
    while (now := metric(url, "prefix_cache_queries_total")) <= before:
        assert time.monotonic() < deadline, f"{url} looked nothing up"
        time.sleep(0.05)
    return now


def test_a_later_turn_is_computed_on_the_decode_worker_alone(local_pd, pd_server, default_model_dir, tokenizer):
    client = openai.OpenAI(base_url=local_pd.v1, api_key="none", max_retries=0, timeout=120)
    plain = openai.OpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    workers = local_pd.workers()
    messages = [{"role": "system", "content": f"Session {uuid.uuid4().hex}. You answer briefly. " * 6},
                {"role": "user", "content": "Name a color."}]

    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens > LOCAL + BLOCK  # nothing of it is held anywhere: through prefill
    prefill_seen = lookups_after(workers["prefill"], 0.0)
    decode_seen = metric(workers["decode"], "prefix_cache_queries_total")
    assert metric(local_pd.url, "local_prefills_total") == 0

    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And a fruit?"}]
    later = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    lookups_after(workers["decode"], decode_seen)  # the decode worker looked the prompt up itself
    assert metric(workers["prefill"], "prefix_cache_queries_total") == prefill_seen
    assert metric(local_pd.url, "local_prefills_total") == 1
    # it reused at least the first turn's full blocks, which came from the prefill worker
    assert later.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // BLOCK * BLOCK

    ours = later.choices[0].message.content
    ref = plain.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    theirs = ref.choices[0].message.content
    assert ours == theirs or chat_near_tie(default_model_dir, tokenizer, messages, ours, theirs), (ours, theirs)
    wait_idle(local_pd)


def test_a_local_stream_its_client_leaves_gives_its_blocks_back(local_pd):
    client = openai.OpenAI(base_url=local_pd.v1, api_key="none", max_retries=0, timeout=120)
    before = metric(local_pd.url, "local_prefills_total")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story."}],
                                            max_tokens=400, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    next(chunk for chunk in stream if chunk.choices and chunk.choices[0].delta.content)
    stream.close()
    assert metric(local_pd.url, "local_prefills_total") == before + 1  # a short prompt: local
    wait_idle(local_pd)
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=4, temperature=0)
    assert again.choices[0].message.content
    wait_idle(local_pd)
