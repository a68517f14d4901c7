"""Admission and internal auth end to end: a real colocated worker that requires the internal
token, and a router process in front of it.

* Overload: 4× more concurrent requests than the configured capacity; the excess gets 429 with
  Retry-After within the queue bound, every admitted request completes correctly, none waits
  unboundedly.
* Internal endpoints without the token are refused (401); liveness stays open; the router,
  which sends the token, serves."""
from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from pdserve.launcher import Child, start_child, stop_children, wait_ready

from tests.frontend.conftest import free_port
from tests.frontend.test_router_faults import CHAT, start

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

TOKEN = "s3cret-internal-token"
CAPACITY = 2                  # the router's --worker-capacity
QUEUE_TIMEOUT_S = 4.0
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def guarded_worker(default_model_dir) -> Iterator[Child]:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "worker", "--role", "both",
           "--model", default_model_dir, "--port", str(port), "--worker-id", f"both-{port}",
           "--threads", "1", "--exit-with-parent"]
    os.environ["PDSERVE_INTERNAL_TOKEN"] = TOKEN  # the child reads it from its environment
    try:
        child = start_child("both", cmd, f"http://127.0.0.1:{port}")
    finally:
        del os.environ["PDSERVE_INTERNAL_TOKEN"]
    wait_ready([child], 300)  # /ready needs no token
    yield child
    stop_children([child])


def test_internal_endpoints_refuse_calls_without_the_token(guarded_worker):
    url = guarded_worker.url
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/ready", timeout=10).status_code == 200
    assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    body = {"request_id": "intruder", "prompt_ids": [1, 2, 3], "params": {"max_tokens": 2}}
    for method, path, payload in (("GET", "/load", None), ("GET", "/info", None),
                                  ("POST", "/abort", {"request_id": "x"}), ("POST", "/generate", body)):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, url + path, json=payload, headers=headers, timeout=10)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "unauthorized"
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(url + "/load", headers=good, timeout=10).status_code == 200


async def _one(http: httpx.AsyncClient, i: int) -> tuple[int, float, httpx.Response]:
    started = time.monotonic()
    r = await http.post(CHAT, json={"messages": [{"role": "user", "content": f"Count to {i + 3}."}],
                                    "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    return i, time.monotonic() - started, r


def test_overload_at_4x_capacity_excess_gets_429_in_bound_admitted_ones_complete(guarded_worker, default_model_dir):
    router = start("router", ["--model", default_model_dir, "--worker", guarded_worker.url,
                              "--internal-token", TOKEN, "--worker-capacity", str(CAPACITY),
                              "--max-queue", str(CAPACITY), "--queue-timeout", str(QUEUE_TIMEOUT_S)])
    try:
        async def burst() -> list[tuple[int, float, httpx.Response]]:
            async with httpx.AsyncClient(base_url=router.url, timeout=300) as http:
                return await asyncio.gather(*(_one(http, i) for i in range(4 * CAPACITY)))

        results = asyncio.run(burst())
        served = [r for _, _, r in results if r.status_code == 200]
        refused = [(took, r) for _, took, r in results if r.status_code == 429]
        assert len(served) + len(refused) == len(results), [r.text for _, _, r in results]
        assert len(served) >= CAPACITY and refused
        for r in served:  # every admitted request completes, correctly
            body = r.json()
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == MAX_TOKENS
        for took, r in refused:
            assert took <= QUEUE_TIMEOUT_S + 3, took  # nobody waits unboundedly
            assert int(r.headers["retry-after"]) >= 1
            error = r.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and set(error) == {"message", "type", "param", "code"}
        metrics = httpx.get(router.url + "/metrics", timeout=10).text
        rejected = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                       if line.startswith("pdserve:admission_rejections_total{"))
        assert rejected == len(refused)
    finally:
        stop_children([router])


def queue_length(url: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=10).text
    return next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("pdserve:admission_queue_length"))


def test_priority_policy_admits_a_smaller_priority_first(guarded_worker, default_model_dir):
    """--scheduling-policy priority with room for one request: while one runs, a request of
    priority 5 and then one of priority -1 queue; the second runs first."""
    router = start("router", ["--model", default_model_dir, "--worker", guarded_worker.url,
                              "--internal-token", TOKEN, "--max-running", "1", "--scheduling-policy", "priority"])

    async def scenario() -> list[str]:
        done: list[str] = []

        async def ask(http: httpx.AsyncClient, name: str, priority: int, first: asyncio.Event | None = None) -> None:
            # the running one is long: both others must queue behind it while it runs
            body = {"messages": [{"role": "user", "content": f"Count for {name}."}],
                    "max_tokens": 600 if first is not None else MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "stream": True, "priority": priority}
            async with http.stream("POST", CHAT, json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if first is not None and line.startswith("data: {"):
                        first.set()
            done.append(name)

        async with httpx.AsyncClient(base_url=router.url, timeout=300) as http:
            running = asyncio.Event()
            tasks = [asyncio.create_task(ask(http, "running", 0, running))]
            await running.wait()  # it holds the one place
            for name, priority, queued in (("low", 5, 1), ("high", -1, 2)):
                tasks.append(asyncio.create_task(ask(http, name, priority)))
                while await asyncio.to_thread(queue_length, router.url) < queued:
                    assert not tasks[0].done(), "the running request ended before the others queued"
                    await asyncio.sleep(0.05)  # polls the router's own count
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
        return done

    try:
        assert asyncio.run(scenario()) == ["running", "high", "low"]
        fcfs = httpx.post(guarded_worker.url + "/generate", timeout=10, json={
            "request_id": "direct", "prompt_ids": [1, 2], "params": {"max_tokens": 1, "priority": 3}},
            headers={"Authorization": f"Bearer {TOKEN}"})
        assert fcfs.status_code == 200  # the worker takes any priority: the router decides
    finally:
        stop_children([router])
