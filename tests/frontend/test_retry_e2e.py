"""A request whose worker dies before its first token is run again elsewhere, and its client
sees only the answer (`pdserve serve --mode pd --decode-workers 2`, supervised).

The fault is made certain: every worker polls nothing while a stall file exists, so a request's
KV write stays in flight (the prefill worker's `kv_writes_in_flight` shows it) and no token can
come. The decode worker holding the request is then killed. The prefill worker has already seen
the room's id, so the run again must use another one, and the answer must equal the one the
same request got before the fault."""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.frontend.conftest import Server, children_of, start_server, stop_server
from tests.frontend.streams import MODEL, read_stream

from pdserve.worker.faults import FaultPlan, RankFaults

pytestmark = [pytest.mark.e2e, pytest.mark.chaos, pytest.mark.timeout(300)]

BODY = {"messages": [{"role": "user", "content": "Name three colours of the rainbow."}], "max_tokens": 12,
        "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[Server, Path]]:
    stall = tmp_path_factory.mktemp("retry") / "stall"
    with pytest.MonkeyPatch.context() as m:
        for name, value in FaultPlan({0: RankFaults(stall_file=str(stall))}).to_env().items():
            m.setenv(name, value)  # every worker serve starts, and restarts, polls nothing while it exists
        srv = start_server("--mode", "pd", "--decode-workers", "2", "--restart-backoff", "0.2")
    yield srv, stall
    stop_server(srv.proc)


def workers(srv: Server) -> list[dict]:
    return httpx.get(f"{srv.url}/health", timeout=10).json()["workers"]


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^pdserve:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def load(url: str) -> dict:
    return httpx.get(f"{url}/load", timeout=10).json()


def idle(url: str) -> bool:
    now = load(url)
    return now["in_flight"] == 0 and now["free_blocks"] == now["total_blocks"]


def worker_pid(srv: Server, url: str) -> int:
    port = url.rsplit(":", 1)[1].encode()
    for pid in children_of(srv.proc.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--port" in argv and argv[argv.index(b"--port") + 1] == port:
            return pid
    raise AssertionError(f"no worker process serves {url}")


def wait_until(what: str, cond, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)
    return value


def finished(url: str) -> float:
    """Requests a worker finished normally (stop or length)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(
        r'^pdserve:request_success_total\{[^}]*finished_reason="(?:stop|length)"[^}]*\} (\S+)$', text, re.M))


def test_a_request_whose_decode_worker_dies_before_its_first_token_is_answered_by_the_other(server):
    srv, stall = server
    url = f"{srv.v1}/chat/completions"
    reference = httpx.post(url, json={"model": MODEL, **BODY}, timeout=120)
    assert reference.status_code == 200, reference.text
    expected = reference.json()["choices"][0]["message"]["content"]
    prefill = next(w["url"] for w in workers(srv) if w["role"] == "prefill")
    decoders = [w["url"] for w in workers(srv) if w["role"] == "decode"]
    retries_before = metric(srv.url, "request_retries_total")
    finished_before = {u: finished(u) for u in decoders}

    stall.touch()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(end=read_stream(url, BODY)), daemon=True)
    thread.start()
    try:
        wait_until("its KV write in flight", lambda: metric(prefill, "kv_writes_in_flight") >= 1, 60)
        victim = wait_until("the decode worker that holds it",
                            lambda: next((u for u in decoders if load(u)["in_flight"] == 1), None), 10)
        os.kill(worker_pid(srv, victim), signal.SIGKILL)
        wait_until("the router sees it gone",
                   lambda: not next(w for w in workers(srv) if w["url"] == victim)["healthy"], 10)
    finally:
        stall.unlink(missing_ok=True)
    thread.join(timeout=120)
    end = result["end"]
    end.assert_clean()
    assert end.done, end.error
    assert end.text == expected
    assert metric(srv.url, "request_retries_total") == retries_before + 1
    survivor = next(u for u in decoders if u != victim)
    assert finished(survivor) == finished_before[survivor] + 1
    wait_until("the killed decode worker back", lambda: all(w["healthy"] for w in workers(srv)), 60)
    wait_until("every KV block free again", lambda: all(idle(w["url"]) for w in workers(srv)), 30)
