"""Cache-aware routing end to end: `pdserve serve --mode colocated --workers 2`. Two multi-turn
conversations, each with its own system prompt: every later turn goes to the worker that served
the conversation's first turn (its prompt's earlier blocks come from that worker's cache, and
each worker's own hit counter shows its conversation), and the answers are those of the PD
server with one worker per role (`pd_server`), turn for turn. Then two more routers over the
same workers (replicas): a turn routed by one reaches, through the other, the worker that holds
it, because that router asks the workers (POST /cached_prefix)."""
from __future__ import annotations

import re
import sys
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from pdserve.block_names import block_hashes, request_salt
from pdserve.launcher import Child, start_child, stop_children, wait_ready
from pdserve.ports import free_port
from tests.frontend.conftest import Server, start_server, stop_server
from tests.frontend.router_cases import API_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16  # the workers' default block size
TURNS = 3


@pytest.fixture(scope="module")
def two_workers() -> Iterator[Server]:
    server = start_server("--mode", "colocated", "--workers", "2")
    yield server
    stop_server(server.proc)


def counter(text: str, name: str, **labels: str) -> float:
    """The value of one series of Prometheus text (0 when absent)."""
    for line in text.splitlines():
        m = re.match(rf"pdserve:{name}{{(.*)}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def worker_urls(server: Server) -> list[str]:
    workers = httpx.get(f"{server.url}/health", timeout=10).json()["workers"]
    assert [w["role"] for w in workers] == ["both", "both"]
    return [w["url"] for w in workers]


def cache_counts(url: str) -> tuple[float, float]:
    """(prompt tokens looked up, prompt tokens found) in one worker's prefix cache."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return counter(text, "prefix_cache_queries_total"), counter(text, "prefix_cache_hits_total")


def served_by(urls: list[str], before: list[tuple[float, float]], cached: int) -> int:
    """The worker whose cache was looked up since `before` (it publishes its counts once idle,
    just after the answer), after checking that its hits are the `cached` tokens reported."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = [cache_counts(u) for u in urls]
        grew = [i for i in range(len(urls)) if now[i][0] > before[i][0]]
        if grew:
            assert len(grew) == 1, (before, now)
            i = grew[0]
            assert now[i][1] - before[i][1] == cached, (before, now, cached)
            return i
        time.sleep(0.05)
    raise AssertionError("no worker counted the request's cache lookup")


def test_later_turns_go_to_the_worker_of_the_first_and_answer_as_one_worker(two_workers, pd_server):
    client = openai.OpenAI(base_url=two_workers.v1, api_key="none", max_retries=0, timeout=120)
    single = openai.OpenAI(base_url=pd_server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    urls = worker_urls(two_workers)
    sessions = [[{"role": "system", "content": f"Session {uuid.uuid4().hex}. You answer briefly. " * 3}]
                for _ in range(2)]
    home: list[int] = []
    previous = [0, 0]
    for turn in range(TURNS):
        for s, messages in enumerate(sessions):
            messages.append({"role": "user", "content": f"Turn {turn}: name a color and a fruit."})
            before = [cache_counts(u) for u in urls]
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
            cached = r.usage.prompt_tokens_details.cached_tokens
            worker = served_by(urls, before, cached)
            if turn == 0:
                assert cached == 0  # its system prompt is new everywhere
                home.append(worker)
            else:  # where its first turn went, which holds at least the previous turn's prompt
                assert worker == home[s], (s, turn)
                assert cached >= previous[s] // BLOCK * BLOCK > 0, (s, turn, cached, previous[s])
            answer = r.choices[0].message.content
            ref = single.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
            assert answer == ref.choices[0].message.content, (s, turn)
            messages.append({"role": "assistant", "content": answer})
            previous[s] = r.usage.prompt_tokens
    assert sorted(home) == [0, 1]  # nothing cached anywhere: the first turns spread by load
    metrics = httpx.get(f"{two_workers.url}/metrics", timeout=10).text
    assert counter(metrics, "routing_decisions_total", reason="prefix") == 2 * (TURNS - 1)
    assert counter(metrics, "routing_decisions_total", reason="load") == 2


def router_over(model_dir: str, urls: list[str], *flags: str) -> Child:
    """`pdserve router` over these workers (in this order), once ready."""
    port = free_port()
    workers = [arg for url in urls for arg in ("--worker", url)]
    cmd = [sys.executable, "-m", "pdserve.cli", "router", "--model", model_dir, *workers, *flags, "--port", str(port)]
    child = start_child("router", cmd, f"http://127.0.0.1:{port}")
    wait_ready([child], 300)
    return child


def held(url: str, prompt_ids: list[int], body: dict | None = None) -> httpx.Response:
    """POST /cached_prefix for a prompt, named as the worker at `url` names it."""
    info = httpx.get(f"{url}/info", timeout=10).json()
    names = block_hashes(prompt_ids, info["block_size"], request_salt(bytes.fromhex(info["prefix_salt"]), None))
    return httpx.post(f"{url}/cached_prefix", json=body or {"names": b"".join(names).hex()}, timeout=10)


@pytest.mark.parametrize("ask", [True, False], ids=["asking", "--no-ask-caches"])
def test_a_turn_routed_by_another_router_finds_the_worker_that_holds_it(two_workers, default_model_dir, ask):
    """Turn 1 goes through a router that knows only the second worker; turn 2 through a router
    over both (the first listed first), which never routed this conversation. Asking the
    workers, it sends turn 2 to the second worker, which reuses turn 1; without asking, it has
    nothing to go by but load, and the first worker computes the whole prompt."""
    urls = worker_urls(two_workers)
    first = router_over(default_model_dir, [urls[1]])
    second = router_over(default_model_dir, urls, *(() if ask else ("--no-ask-caches",)))
    try:
        messages = [{"role": "system", "content": f"Session {uuid.uuid4().hex}. You answer briefly. " * 3},
                    {"role": "user", "content": "Turn 0: name a color and a fruit."}]
        before = [cache_counts(u) for u in urls]
        r = httpx.post(f"{first.url}/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": 6, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert served_by(urls, before, 0) == 1
        prompt_ids = r.json()["prompt_token_ids"]
        # what each worker says it holds of turn 1's prompt: all its full blocks, or nothing
        for url, blocks in ((urls[1], len(prompt_ids) // BLOCK), (urls[0], 0)):
            answer = held(url, prompt_ids).json()
            assert (answer["device_blocks"], answer["host_blocks"]) == (blocks, 0), (url, answer)
            assert answer["load"]["in_flight"] == 0 and answer["load"]["total_blocks"] > 0, answer
        bad = held(urls[1], prompt_ids, {"names": "abc"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_request", bad.text

        messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Turn 1: and a vegetable?"}]
        before = [cache_counts(u) for u in urls]
        r = httpx.post(f"{second.url}/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        metrics = httpx.get(f"{second.url}/metrics", timeout=10).text
        if ask:
            assert served_by(urls, before, cached) == 1
            assert cached >= len(prompt_ids) // BLOCK * BLOCK > 0, (cached, len(prompt_ids))
            assert counter(metrics, "routing_decisions_total", reason="prefix") == 1
            assert counter(metrics, "routing_cache_queries_total", outcome="answered") == 2
        else:
            assert served_by(urls, before, cached) == 0
            assert cached == 0
            assert counter(metrics, "routing_decisions_total", reason="load") == 1
            assert counter(metrics, "routing_cache_queries_total", outcome="answered") == 0
    finally:
        stop_children([first, second])
