"""Priority end to end under `--scheduling-policy priority`, with `--max-num-seqs 1` (so the
router's capacity for a worker is 2).

Colocated: two requests of priority 5 fill the worker, one streams, one waits on it. A request
of priority -1 then passes the full router and takes the running one's place at once: it ends
first, the worker counts one preemption, and the preempted request, recomputed, answers as it
does alone.

PD, a small decode pool: two long prompts of priority 5 hold most of the decode worker's
blocks; a room of priority -1 that needs more than are free preempts one of them there in the
step it arrives (without it, the room waits for one to end and nothing is preempted), and the
preempted one, recomputed on the decode worker, answers as it does alone.

PD: a request of priority 5 streams from the decode worker's one slot; a second one's KV lands
and waits for the slot, its first token held back with it. A request of priority -1 passes the
full router at once, takes the slot when its KV lands and ends first, then the two others in
their order; nothing is preempted."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.frontend.conftest import Server, start_server, stop_server
from tests.served_reference import chat_near_tie

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

CHAT = "/v1/chat/completions"
LONG = {"messages": [{"role": "user", "content": "Count from one to one hundred in words."}],
        "max_tokens": 96, "temperature": 0, "ignore_eos": True, "priority": 5}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = start_server("--mode", "colocated", "--max-num-seqs", "1", "--scheduling-policy", "priority")
    yield srv
    stop_server(srv.proc)


@pytest.fixture(scope="module")
def pd() -> Iterator[Server]:
    srv = start_server("--mode", "pd", "--max-num-seqs", "1", "--scheduling-policy", "priority")
    yield srv
    stop_server(srv.proc)


@pytest.fixture(scope="module")
def pd_small() -> Iterator[Server]:
    srv = start_server("--mode", "pd", "--kv-cache-memory", "64MiB", "--scheduling-policy", "priority")
    yield srv
    stop_server(srv.proc)


def worker_metric(srv: Server, name: str, role: str = "both") -> float:
    """A metric of a worker (its /metrics, found through the router's /health)."""
    text = httpx.get(srv.workers()[role] + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def streamed(http: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None,
                   parts: list[str] | None = None) -> str:
    """A streamed chat answer's content; `started` is set at its first piece; `parts` (if
    given) receives the pieces as they come."""
    parts = [] if parts is None else parts
    async with http.stream("POST", CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    parts.append(choices[0]["delta"]["content"])
                    if started is not None:
                        started.set()
    return "".join(parts)


def test_a_smaller_priority_passes_the_full_router_and_preempts_the_running_request(
        server, default_model_dir, tokenizer):
    expected = httpx.post(server.url + CHAT, json=LONG, timeout=300).json()["choices"][0]["message"]["content"]
    before = worker_metric(server, "pdserve:num_preemptions_total")

    async def scenario() -> tuple[list[str], dict[str, str]]:
        ended: list[str] = []
        texts: dict[str, str] = {}
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            streaming = asyncio.Event()

            async def ask(name: str, body: dict) -> None:
                texts[name] = await streamed(http, body, streaming if name == "low-1" else None)
                ended.append(name)

            tasks = [asyncio.create_task(ask("low-1", LONG))]
            await streaming.wait()  # it holds the worker's one running slot, mid-answer
            tasks.append(asyncio.create_task(ask("low-2", LONG)))
            while await asyncio.to_thread(worker_metric, server, "pdserve:num_requests_waiting") < 1:
                assert not tasks[0].done(), "low-1 ended before low-2 queued behind it"
                await asyncio.sleep(0.02)  # polls the worker's own count
            await ask("high", {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                               "temperature": 0, "ignore_eos": True, "priority": -1})
            assert not tasks[0].done(), "low-1 ended before the high-priority request"
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
        return ended, texts

    ended, texts = asyncio.run(scenario())
    assert ended == ["high", "low-1", "low-2"]
    assert worker_metric(server, "pdserve:num_preemptions_total") - before == 1
    for name in ("low-1", "low-2"):  # low-1 recomputed from its tokens: its answer, bar a near-tie
        got = texts[name]
        assert got == expected or chat_near_tie(default_model_dir, tokenizer, LONG["messages"], got, expected)


def test_in_pd_a_smaller_priority_passes_the_full_router_and_takes_the_decode_slot(pd):
    roles = ("prefill", "decode")
    before = {role: worker_metric(pd, "pdserve:num_preemptions_total", role) for role in roles}
    decode = pd.workers()["decode"]

    async def scenario() -> list[str]:
        ended: list[str] = []
        async with httpx.AsyncClient(base_url=pd.url, timeout=300) as http:
            async def ask(name: str, body: dict, started: asyncio.Event | None = None,
                          parts: list[str] | None = None) -> None:
                await streamed(http, body, started, parts)
                ended.append(name)

            started = asyncio.Event()
            parts: dict[str, list[str]] = {"low-1": [], "low-2": []}
            tasks = [asyncio.create_task(ask("low-1", LONG, started, parts["low-1"]))]
            await asyncio.wait_for(started.wait(), 120)  # it holds the decode worker's one slot
            tasks.append(asyncio.create_task(ask("low-2", LONG, None, parts["low-2"])))
            # low-2's KV lands and waits for the slot, its first token with it
            while (await http.get(decode + "/load")).json()["waiting"] < 1:
                assert not tasks[0].done(), "low-1 ended before low-2's room waited for the slot"
                await asyncio.sleep(0.02)  # polls the decode worker's own count
            assert parts["low-2"] == [] and not tasks[0].done()
            await ask("high", {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                               "temperature": 0, "ignore_eos": True, "priority": -1})
            assert not tasks[0].done(), "low-1 ended before the high-priority request"
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
        return ended

    ended = asyncio.run(scenario())
    assert ended == ["high", "low-1", "low-2"]
    assert {role: worker_metric(pd, "pdserve:num_preemptions_total", role) for role in roles} == before


def test_in_pd_a_smaller_priority_takes_the_decode_blocks_of_a_running_larger_one(
        pd_small, default_model_dir, tokenizer):
    def chat(text: str, max_tokens: int, priority: int) -> dict:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "priority": priority}

    # two prompts of ≈ 37 blocks each (distinct: shared blocks would not come back when one is preempted)
    longs = {"low-1": chat("Summarize: " + "The quick brown fox jumps over the lazy dog. " * 52, 40, 5),
             "low-2": chat("Summarize: " + "Pack my box with five dozen liquor jugs, said the cook. " * 45, 40, 5)}
    high = chat("Translate: " + "A bird in the hand is worth two in the bush. " * 30, 8, -1)
    expected = {name: httpx.post(pd_small.url + CHAT, json=body, timeout=300).json()["choices"][0]["message"]["content"]
                for name, body in longs.items()}
    high_blocks = -(-httpx.post(pd_small.url + "/tokenize", json={"messages": high["messages"]}).json()["count"] // 16)
    decode = pd_small.workers()["decode"]
    before = {role: worker_metric(pd_small, "pdserve:num_preemptions_total", role) for role in ("prefill", "decode")}

    async def scenario() -> tuple[list[str], dict[str, str], int]:
        ended: list[str] = []
        texts: dict[str, str] = {}
        async with httpx.AsyncClient(base_url=pd_small.url, timeout=300) as http:
            async def ask(name: str, body: dict, started: asyncio.Event | None = None) -> None:
                texts[name] = await streamed(http, body, started)
                ended.append(name)

            started = {name: asyncio.Event() for name in ("low-1", "low-2")}
            tasks = [asyncio.create_task(ask(name, longs[name], started[name])) for name in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 120)
            free = (await http.get(decode + "/load")).json()["free_blocks"]  # both rooms landed
            await ask("high", high)
            assert not all(t.done() for t in tasks), "both long answers ended before the high-priority one"
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
        return ended, texts, free

    ended, texts, free = asyncio.run(scenario())
    assert free < high_blocks  # the premise: the room does not fit the decode worker's free blocks
    assert sorted(ended) == ["high", "low-1", "low-2"]
    after = {role: worker_metric(pd_small, "pdserve:num_preemptions_total", role) for role in ("prefill", "decode")}
    assert after["decode"] - before["decode"] == 1 and after["prefill"] == before["prefill"]
    for name, body in longs.items():  # the preempted one recomputed on the decode worker: its answer, bar a near-tie
        got = texts[name]
        assert got == expected[name] or chat_near_tie(default_model_dir, tokenizer, body["messages"], got,
                                                      expected[name])
