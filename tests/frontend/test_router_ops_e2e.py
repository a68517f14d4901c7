"""`pdserve serve --mode pd` operated as a deployment would be: the /metrics of the router and of
both workers count exactly what a scripted workload did (aborts by the origin the router names,
under one model_name label), and SIGTERM during 32 streams drains:
new requests get 503, every stream ends with [DONE] or a clean error event within the drain
timeout, the KV pools are full again, the process exits 0 and no worker process is left.

Each test starts its own server (about 10 s on two shared cores), so counters start at zero."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.metrics import ABORT_ORIGINS

from tests.frontend.conftest import children_of, start_server, stop_server

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
ROUTER = {"model_name": MODEL, "role": "router"}


def metrics(url: str) -> dict[tuple[str, frozenset], float]:
    """GET /metrics through the Prometheus text parser: (sample name, labels) → value."""
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def value(m: dict, name: str, **labels: str) -> float:
    hits = [v for (n, ls), v in m.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def body(prompt: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
            "temperature": 0, **fields}


def process_groups() -> dict[int, list[int]]:
    """Process group id → live member pids (zombies excluded), from /proc."""
    out: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            out.setdefault(int(fields[2]), []).append(int(stat.parent.name))
    return out


@pytest.mark.timeout(300)
def test_metrics_of_router_and_workers_count_a_scripted_workload():
    server = start_server("--mode", "pd")
    try:
        workers = {w["role"]: w["url"] for w in httpx.get(f"{server.url}/ready", timeout=10).json()["workers"]}
        assert set(workers) == {"prefill", "decode"}
        usage = []
        with httpx.Client(base_url=server.v1, timeout=120) as http:
            # four requests run to their length: two plain, one streamed (with usage), one more
            for prompt in ("Say hello.", "Name a color."):
                usage.append(http.post("/chat/completions", json=body(prompt, ignore_eos=True)).json()["usage"])
            streamed = http.post("/chat/completions", json=body("Count to five.", ignore_eos=True, stream=True,
                                                                   stream_options={"include_usage": True}))
            usage.append(json.loads(streamed.text.split("data: ")[-2])["usage"])
            first = http.post("/chat/completions", json=body("Say hello.", ignore_eos=True)).json()
            usage.append(first["usage"])
            # one stop string, met in the first token: the router aborts the room (origin "router")
            text = first["choices"][0]["message"]["content"]
            cut = http.post("/chat/completions", json=body("Say hello.", ignore_eos=True, stop=[text[1:4]])).json()
            assert cut["choices"][0]["finish_reason"] == "stop"
            usage.append(cut["usage"])
            # one stream its client leaves after 3 tokens (origin "client")
            seen = 0
            with http.stream("POST", "/chat/completions",
                             json=body("Say hello.", max_tokens=200, ignore_eos=True, stream=True)) as r:
                for line in r.iter_lines():
                    chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
                    seen += bool(chunk.get("choices") and chunk["choices"][0]["delta"].get("content"))
                    if seen == 3:
                        break
            usage.append({"prompt_tokens": usage[0]["prompt_tokens"], "completion_tokens": 0})
            # refused before any worker (400): not a request of the metrics
            assert http.post("/chat/completions", json=body("x", n=0)).status_code == 400
        wait_idle(workers)
        lengths, stops, left = 4, 1, 1
        accepted = lengths + stops + left
        prompt_tokens = sum(u["prompt_tokens"] for u in usage)
        finished_tokens = sum(u["completion_tokens"] for u in usage)

        r = metrics(server.url)
        assert value(r, "pdserve:request_success_total", finished_reason="length", **ROUTER) == lengths
        assert value(r, "pdserve:request_success_total", finished_reason="stop", **ROUTER) == stops
        assert value(r, "pdserve:request_success_total", finished_reason="abort", **ROUTER) == left
        assert value(r, "pdserve:request_success_total", finished_reason="error", **ROUTER) == 0
        assert value(r, "pdserve:aborts_total", origin="router", **ROUTER) == stops
        assert value(r, "pdserve:aborts_total", origin="client", **ROUTER) == left
        assert value(r, "pdserve:prompt_tokens_total", **ROUTER) == prompt_tokens
        generated = value(r, "pdserve:generation_tokens_total", **ROUTER)
        assert finished_tokens + 3 <= generated <= finished_tokens + 200  # the client left after 3
        assert value(r, "pdserve:time_to_first_token_seconds_count", **ROUTER) == accepted
        assert value(r, "pdserve:e2e_request_latency_seconds_count", **ROUTER) == accepted
        # one inter-token sample per token after each request's first
        assert value(r, "pdserve:inter_token_latency_seconds_count", **ROUTER) == generated - accepted
        assert value(r, "pdserve:num_requests_running", **ROUTER) == 0
        assert value(r, "pdserve:num_requests_waiting", **ROUTER) == 0

        # The workers count the aborts the router asked for, by the origin it named: one stop
        # string ("router"), one client that left ("client"). The decode worker ran both; the
        # prefill worker had finished its part (aborts of finished requests count nothing).
        decode_url = workers["decode"]
        wait_for_value(lambda: sum(value(metrics(decode_url), "pdserve:aborts_total", origin=o)
                                   for o in ABORT_ORIGINS), stops + left)
        bogus = httpx.post(f"{decode_url}/abort", json={"request_id": "nope", "origin": "bogus"}, timeout=5)
        error = bogus.json()["error"]  # the contract's ErrorBody
        assert bogus.status_code == 400 and error["code"] == "bad_request" and "bogus" in error["message"]
        unknown = httpx.post(f"{decode_url}/abort", json={"request_id": "nope", "origin": "router"}, timeout=5)
        assert unknown.status_code == 200 and unknown.json() == {"ok": True, "aborted": False}
        p, d = metrics(workers["prefill"]), metrics(decode_url)
        aborts = {o: value(d, "pdserve:aborts_total", origin=o) for o in (*ABORT_ORIGINS, "other")}
        assert aborts == {"client": left, "router": stops, "peer": 0, "timeout": 0, "drain": 0, "other": 0}
        assert value(p, "pdserve:aborts_total", origin="peer") == value(p, "pdserve:aborts_total", origin="other") == 0
        # One model_name on every series of router and workers: `pdserve serve` hands the
        # router's served name to its workers.
        for m in (r, p, d):
            assert {dict(labels).get("model_name") for _, labels in m} == {MODEL}
        for m in (p, d):  # every accepted request had one KV transfer room, and it completed
            assert value(m, "pdserve:rooms_total", state="done") == accepted
            assert value(m, "pdserve:rooms_total", state="failed") == 0
            assert value(m, "pdserve:rooms_total", state="aborted") == 0
            assert value(m, "pdserve:prompt_tokens_total") == prompt_tokens
            assert value(m, "pdserve:num_requests_running") == value(m, "pdserve:num_requests_waiting") == 0
            assert value(m, "pdserve:kv_blocks_used") == 0
        assert value(p, "pdserve:generation_tokens_total") == accepted  # the first token of each
        assert value(p, "pdserve:kv_transfer_bytes_total") > 0
        assert value(d, "pdserve:request_success_total", finished_reason="length") == lengths
        assert value(d, "pdserve:request_success_total", finished_reason="abort") == stops + left
        assert value(d, "pdserve:generation_tokens_total") >= generated
    finally:
        code = stop_server(server.proc)
    assert code == 0, "\n".join(server.log)


def wait_for_value(read, expected: float, timeout_s: float = 5.0) -> None:
    """Until `read()` equals `expected` (an abort reaches the worker just after its stream ends)."""
    deadline = time.monotonic() + timeout_s
    while (got := read()) != expected:
        assert time.monotonic() < deadline, (got, expected)
        time.sleep(0.05)


def wait_idle(workers: dict[str, str], timeout_s: float = 10.0) -> None:
    """Until every worker is idle by its /load and by its gauges (which its loop snapshots)."""
    def idle(url: str) -> bool:
        x = httpx.get(f"{url}/load", timeout=5).json()
        if not (x["in_flight"] == x["running"] == x["waiting"] == 0 and x["free_blocks"] == x["total_blocks"]):
            return False
        m = metrics(url)
        return (value(m, "pdserve:num_requests_running") == value(m, "pdserve:num_requests_waiting")
                == value(m, "pdserve:kv_blocks_used") == 0)

    deadline = time.monotonic() + timeout_s
    while not all(idle(u) for u in workers.values()):
        assert time.monotonic() < deadline, [httpx.get(f"{u}/load", timeout=5).json() for u in workers.values()]
        time.sleep(0.1)


DRAIN_S = 20
STREAMS = 32
AT_EXIT = re.compile(r"at exit: (prefill|decode) worker: (\d+)/(\d+) KV blocks free, (\d+) waiting, (\d+) running, "
                     r"(\d+) transferring, (\d+) in flight")


@pytest.mark.timeout(300)
def test_sigterm_during_32_streams_drains_finishes_or_stops_each_and_exits_zero(tmp_path):
    log_path = tmp_path / "serve.log"
    server = start_server("--mode", "pd", "--drain-timeout", str(DRAIN_S), log_path=log_path)
    workers = children_of(server.proc.pid)  # each leads its own process group (its TP ranks too)
    assert len(workers) == 2

    async def streams() -> tuple[float, httpx.Response, list[tuple[bool, list[str], float]]]:
        opened = 0

        async def stream(http: httpx.AsyncClient, i: int) -> tuple[bool, list[str], float]:
            nonlocal opened
            # short ones can finish within the drain timeout; long ones cannot. A stream opens at
            # its first token, so a short one must outlast the others' prefills (all in flight at
            # the signal)
            short = i % 2 == 0
            events: list[str] = []
            req = body(f"Tell me about the number {i}.", max_tokens=96 if short else 2000, ignore_eos=True,
                       stream=True)
            async with http.stream("POST", "/chat/completions", json=req) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        opened += len(events) == 1
            return short, events, time.monotonic()

        async with httpx.AsyncClient(base_url=server.v1, timeout=120,
                                     limits=httpx.Limits(max_connections=2 * STREAMS)) as http:
            tasks = [asyncio.create_task(stream(http, i)) for i in range(STREAMS)]
            deadline = time.monotonic() + 60
            while opened < STREAMS:  # every stream accepted and under way
                assert time.monotonic() < deadline and not any(t.done() for t in tasks)
                await asyncio.sleep(0.05)
            sigterm_at = time.monotonic()
            os.kill(server.proc.pid, signal.SIGTERM)
            while (await http.get(f"{server.url}/ready")).status_code == 200:  # until the signal is handled
                assert time.monotonic() - sigterm_at < 5
                await asyncio.sleep(0.02)
            refused = await http.post("/chat/completions", json=body("Hi"))
            return sigterm_at, refused, await asyncio.gather(*tasks)

    try:
        sigterm_at, refused, results = asyncio.run(streams())
        code = server.proc.wait(timeout=DRAIN_S + 30)
        exited_at = time.monotonic()
    finally:
        stop_server(server.proc)
    log = read_log(log_path, until=lambda text: len(AT_EXIT.findall(text)) == 2)
    assert code == 0, log[-5000:]
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "service_unavailable"

    finished = stopped = 0
    for short, events, ended_at in results:
        assert ended_at - sigterm_at < DRAIN_S + 5
        if events[-1] == "[DONE]":
            assert short and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            finished += 1
        else:  # a clean end: an OpenAI error object as the last event, no [DONE]
            error = json.loads(events[-1])["error"]
            assert error["code"] == "service_unavailable" and "shutting down" in error["message"], error
            stopped += 1
    assert finished + stopped == STREAMS and stopped >= STREAMS // 2 and finished >= 1, (finished, stopped)
    assert exited_at - sigterm_at < DRAIN_S + 15
    assert f"draining: {STREAMS} request(s) in flight" in log
    stopping = re.search(r"drain timeout: stopping (\d+) request\(s\) still running", log)
    assert stopping and int(stopping[1]) >= STREAMS // 2

    pools = {m[1]: [int(x) for x in m.groups()[1:]] for m in AT_EXIT.finditer(log)}
    assert set(pools) == {"prefill", "decode"}, log[-5000:]
    for role, (free, total, waiting, running, transferring, in_flight) in pools.items():
        assert free == total > 0 and waiting == running == transferring == in_flight == 0, (role, pools)
    groups = process_groups()
    assert [pid for pid in workers if pid in groups] == []  # no worker, no rank, no orphan


def read_log(path: Path, until, timeout_s: float = 5.0) -> str:
    """The server's log file once `until(text)` holds (its relay may lag the exit a little)."""
    deadline = time.monotonic() + timeout_s
    text = path.read_text()
    while not until(text) and time.monotonic() < deadline:
        time.sleep(0.1)
        text = path.read_text()
    return text
