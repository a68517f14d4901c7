"""Cache-aware routing end to end: `pdserve serve --mode colocated --workers 2`. Two multi-turn
conversations, each with its own system prompt: every later turn goes to the worker that served
the conversation's first turn (its prompt's earlier blocks come from that worker's cache, and
each worker's own hit counter shows its conversation), and the answers are those of the PD
server with one worker per role (`pd_server`), turn for turn."""
from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

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
