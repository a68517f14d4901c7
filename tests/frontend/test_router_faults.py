"""Workers that die or stop answering under a streaming request. Dead (killed, port refused):
the client gets an error within 2 s, the worker leaves the rotation, and comes back (or its
replacement does) when healthy. Paused (SIGSTOP): busy is not dead, its requests go on after
SIGCONT; only silence past the router's bound fails them, with an error that says so.

Real worker and router processes, started as `pdserve serve` starts them (the router's log, at
INFO, is what a failure here shows: which worker it saw slow or dead, and when)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.launcher import Child, start_child, stop_children, wait_ready

from tests.frontend.conftest import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

CHAT = "/v1/chat/completions"
LONG = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 3000,
        "temperature": 0, "ignore_eos": True, "stream": True}
SHORT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3, "temperature": 0}
FAIL_FAST_S = 2.0
SILENCE_BOUND_S = 8.0  # the cluster router's dead_after_s
PAUSE_S = 3.0          # a pause well inside it


def start(role: str, args: list[str], port: int | None = None) -> Child:
    """`pdserve ROLE ARGS` on loopback, once its /ready says so."""
    import sys

    port = port or free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "INFO", role, *args, "--port", str(port)]
    child = start_child(role, cmd, f"http://127.0.0.1:{port}")
    wait_ready([child], 300)
    return child


def worker(role: str, model_dir: str, port: int | None = None) -> Child:
    return start(role, ["--model", model_dir, "--worker-id", f"{role}-{time.time_ns()}", "--threads", "1",
                        "--exit-with-parent"], port)


@pytest.fixture(scope="module")
def cluster(default_model_dir) -> Iterator[dict]:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    prefill = worker("prefill", default_model_dir)
    decode = worker("decode", default_model_dir)
    # a short silence bound, so that the paused-past-the-bound case takes seconds, not half a minute
    router = start("router", ["--model", default_model_dir, "--prefill", prefill.url, "--decode", decode.url,
                              "--slow-after", "1", "--dead-after", str(SILENCE_BOUND_S)])
    state = {"prefill": prefill, "decode": decode, "router": router, "model_dir": default_model_dir}
    yield state
    stop_children([router, state["prefill"], state["decode"]])


def stream_until_error(url: str, after_tokens: int, fault, body: dict = LONG) -> tuple[float, dict]:
    """Stream `body`; after `after_tokens` events call `fault()`; return (seconds to error, error)."""
    with httpx.Client(timeout=60) as http, http.stream("POST", url + CHAT, json=body) as r:
        assert r.status_code == 200
        seen, faulted_at = 0, None
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            assert payload != "[DONE]", "the stream finished instead of failing"
            body = json.loads(payload)
            if "error" in body:
                return time.monotonic() - faulted_at, body["error"]
            seen += 1
            if seen == after_tokens:
                fault()
                faulted_at = time.monotonic()
    raise AssertionError("the stream ended without an error event")


def router_health(url: str) -> int:
    """The router's readiness: 200 while a prefill and a decode worker take requests."""
    return httpx.get(url + "/ready", timeout=5).status_code


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def stream_through(url: str, after_tokens: int, fault, body: dict) -> tuple[int, str]:
    """Stream `body`; after `after_tokens` events call `fault()`; return (token events, last
    payload): "[DONE]" for a stream that finished, else the error event's JSON."""
    with httpx.Client(timeout=120) as http, http.stream("POST", url + CHAT, json=body) as r:
        assert r.status_code == 200
        seen, last = 0, ""
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            last = line[6:]
            if last == "[DONE]" or "error" in json.loads(last):
                return seen, last
            seen += 1
            if seen == after_tokens:
                fault()
    return seen, last


def test_a_paused_worker_is_slow_not_dead_its_stream_and_a_new_request_complete(cluster):
    """SIGSTOP inside the silence bound, then SIGCONT: the stream in flight finishes with [DONE],
    and a request sent during the pause waits in the admission queue and is served (no 503)."""
    router, decode = cluster["router"], cluster["decode"]
    pid = decode.proc.pid
    during: dict = {}

    def pause_then_resume() -> None:
        os.killpg(pid, signal.SIGSTOP)

        def resume() -> None:
            time.sleep(PAUSE_S)  # the fault's duration, not a synchronization
            os.killpg(pid, signal.SIGCONT)

        threading.Thread(target=resume, daemon=True).start()
        asker = threading.Thread(target=lambda: during.update(
            r=httpx.post(router.url + CHAT, json=SHORT, timeout=120)), daemon=True)
        asker.start()
        during["thread"] = asker

    body = {**LONG, "max_tokens": 40}
    try:
        seen, last = stream_through(router.url, 3, pause_then_resume, body)
    finally:
        os.killpg(pid, signal.SIGCONT)
    assert last == "[DONE]" and seen >= 3, last
    during["thread"].join(timeout=120)
    assert during["r"].status_code == 200, during["r"].text
    assert router_health(router.url) == 200
    wait_for(lambda: _idle(decode.url), 10, "the decode worker's blocks back in its pool")


def test_a_worker_silent_past_the_bound_fails_its_stream_with_a_clear_error(cluster):
    router, decode = cluster["router"], cluster["decode"]
    pid = decode.proc.pid
    try:
        elapsed, error = stream_until_error(router.url, 3, lambda: os.killpg(pid, signal.SIGSTOP))
        assert SILENCE_BOUND_S - 1 <= elapsed <= SILENCE_BOUND_S + 3, elapsed
        assert error["code"] == "service_unavailable" and "did not answer for" in error["message"], error
    finally:
        os.killpg(pid, signal.SIGCONT)
    wait_for(lambda: router_health(router.url) == 200, 15, "the decode worker back in rotation")
    assert httpx.post(router.url + CHAT, json=SHORT, timeout=60).status_code == 200
    wait_for(lambda: _idle(decode.url), 10, "the decode worker's blocks back in its pool")


def test_a_killed_decode_worker_fails_its_stream_within_2s_and_a_new_one_serves(cluster):
    router, decode = cluster["router"], cluster["decode"]
    port = int(decode.url.rsplit(":", 1)[1])
    elapsed, error = stream_until_error(router.url, 3, lambda: os.killpg(decode.proc.pid, signal.SIGKILL))
    assert elapsed <= FAIL_FAST_S, elapsed
    assert error["type"] == "server_error"
    decode.proc.wait(timeout=10)
    wait_for(lambda: router_health(router.url) == 503, 5, "the router to notice")
    cluster["decode"] = worker("decode", cluster["model_dir"], port)  # same URL, new process and id
    wait_for(lambda: router_health(router.url) == 200, 10, "the new decode worker in rotation")
    r = httpx.post(router.url + CHAT, json=SHORT, timeout=60)
    assert r.status_code == 200, r.text
    wait_for(lambda: _idle(cluster["prefill"].url), 10, "the prefill worker idle")


def test_a_prefill_worker_killed_mid_prefill_fails_the_request_within_2s(cluster):
    router, prefill = cluster["router"], cluster["prefill"]
    port = int(prefill.url.rsplit(":", 1)[1])
    body = {**LONG, "messages": [{"role": "user", "content": " hello" * 3000}], "max_tokens": 4}
    # the decode worker detects a dead source by pinging the sources it has heard from: one
    # request first, so that this prefill worker has connected (a source killed before its first
    # write is only fenced by the 30 s fence lease — issue 20 lets the router say it is dead)
    assert httpx.post(router.url + CHAT, json=SHORT, timeout=60).status_code == 200

    def kill_during_prefill() -> None:
        deadline = time.monotonic() + 30
        while httpx.get(prefill.url + "/load", timeout=5).json()["running"] == 0:  # until its prefill runs
            assert time.monotonic() < deadline, "the prefill never started"
            time.sleep(0.02)
        os.killpg(prefill.proc.pid, signal.SIGKILL)

    # before the first token a stream's failure is its HTTP status, not a 200 with an error event
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(httpx.post(router.url + CHAT, json=body, timeout=60)))
    sender.start()
    kill_during_prefill()
    killed_at = time.monotonic()
    sender.join(timeout=60)
    elapsed = time.monotonic() - killed_at
    assert elapsed <= FAIL_FAST_S, elapsed
    assert answer[0].status_code == 503 and answer[0].json()["error"]["type"] == "server_error", answer[0].text
    prefill.proc.wait(timeout=10)
    wait_for(lambda: _idle(cluster["decode"].url), 10, "the decode worker's blocks back in its pool")
    cluster["prefill"] = worker("prefill", cluster["model_dir"], port)
    wait_for(lambda: router_health(router.url) == 200, 10, "the new prefill worker in rotation")
    r = httpx.post(router.url + CHAT, json=SHORT, timeout=60)
    assert r.status_code == 200, r.text


def _idle(url: str) -> bool:
    load = httpx.get(url + "/load", timeout=5).json()
    return load["running"] == load["waiting"] == load["transferring"] == 0 and \
        load["free_blocks"] == load["total_blocks"]


def test_worker_pids_are_ours(cluster):
    """Sanity: the processes this module kills are the workers it started."""
    for role in ("prefill", "decode"):
        cmdline = Path(f"/proc/{cluster[role].proc.pid}/cmdline").read_bytes().split(b"\0")
        assert role.encode() in cmdline
