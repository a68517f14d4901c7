"""`pdserve serve` supervises its workers (issue 20), as a user sees it, on one server shared by
the module (the tests run in order and share its restart history):

* SIGKILL of the prefill worker while streams decode: the streams end with [DONE]; a new
  request waits in the admission queue for the restarted worker and is served within 30 s;
  serve keeps running; the pools are full at the end.
* SIGKILL of the decode worker: its streams go on from their last token on the restarted
  worker and end with [DONE], their text that of an uninterrupted run: greedy, with a presence
  penalty, seeded, and under a grammar.
* A router that stops answering (SIGSTOP) with streams in flight: the workers abort them once
  its lease ran out, and every block comes back; after SIGCONT the streams go on to [DONE].
* A crash loop (the model directory vanished: each restart fails at once) ends serve with the
  worker's own error as one line and exit 1.
* `--tp 2` on the default model (9 heads) is refused in one line, in under 3 s.

Every stream is read by `streams.read_stream`, which fails on a stream that ends with neither
[DONE] nor an error event."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.frontend.conftest import Server, children_of, serve_command, start_server, stop_server
from tests.frontend.streams import MODEL, Streams
from tests.served_reference import chat_near_tie

pytestmark = [pytest.mark.e2e, pytest.mark.chaos, pytest.mark.timeout(300)]

STORY = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 32,
         "ignore_eos": True, "temperature": 0}
BACK_WITHIN_S = 30.0
MAX_RESTARTS = 2
LEASE_S = 5.0  # the workers' --router-lease


@pytest.fixture(scope="module")
def server(default_model_dir: str, tmp_path_factory) -> Iterator[tuple[Server, Path]]:
    """serve on a symlink to the default model (the crash-loop test removes it)."""
    link = tmp_path_factory.mktemp("supervised") / "model"
    link.symlink_to(default_model_dir)
    srv = start_server("--mode", "pd", "--model", str(link), "--served-model-name", MODEL, "--restart-max", str(MAX_RESTARTS),
                       "--restart-window", "600", "--restart-backoff", "0.2", f"--worker-arg=--router-lease={LEASE_S:g}")
    yield srv, link
    stop_server(srv.proc)


def worker_pid(srv: Server, role: str) -> int:
    """The pid of the worker process (its TP rank 0) of `role`."""
    for pid in children_of(srv.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if role.encode() in argv:
            return pid
    raise AssertionError(f"no {role} worker under serve (pid {srv.proc.pid})")


def router_health(srv: Server) -> dict[str, dict]:
    return {w["role"]: w for w in httpx.get(f"{srv.url}/health", timeout=10).json()["workers"]}


def wait_until(what: str, cond, timeout_s: float, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def chat(srv: Server, timeout_s: float = 60.0) -> httpx.Response:
    return httpx.post(f"{srv.v1}/chat/completions", timeout=timeout_s,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4})


def pools_full(srv: Server) -> bool:
    for w in router_health(srv).values():
        load = httpx.get(f"{w['url']}/load", timeout=10).json()
        busy = load["waiting"] + load["running"] + load["transferring"] + load.get("in_flight", 0)
        if busy or load["free_blocks"] != load["total_blocks"]:
            return False
    return True


def test_a_killed_prefill_worker_is_restarted_and_decoding_streams_finish(server):
    srv, _ = server
    streams = Streams(f"{srv.v1}/chat/completions", STORY, 4)
    streams.wait_started()  # every stream is decoding: none needs the prefill worker any more
    os.kill(worker_pid(srv, "prefill"), signal.SIGKILL)
    killed = time.monotonic()
    # once the router knows it is gone, a new request waits in the admission queue for the
    # restarted worker (no 503)
    wait_until("the router sees the prefill worker down", lambda: not router_health(srv)["prefill"]["healthy"], 10)
    r = chat(srv)
    back = time.monotonic() - killed
    assert r.status_code == 200, r.text
    assert back < BACK_WITHIN_S
    ends = streams.join()
    assert all(e.done for e in ends), [e.error for e in ends]
    assert srv.proc.poll() is None
    wait_until("every KV block is free again", lambda: pools_full(srv), 10, 0.2)
    print(f"prefill killed: 4/4 streams [DONE]; served again {back:.1f} s after the kill")


# Each kind of stream a decode worker's death interrupts, and how many tokens it asks for: in
# these, the reference model's top two logits stay at least 0.08 apart, so a run that goes on
# from a prompt-computed KV picks the same ones (the greedy story's come within 0.02 by token
# 71; the penalized one's within 0.03 at token 32). The seeded one samples: its draws differ
# only where a logit moves across a draw's boundary, at ~1e-4 of a logit.
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
          "required": ["title", "story"]}
RESUMED = {
    "greedy": {**STORY, "max_tokens": 48},
    "presence penalty": {**STORY, "max_tokens": 30, "presence_penalty": 0.5},
    "seeded": {**STORY, "max_tokens": 48, "temperature": 0.8, "seed": 5},
    "grammar": {**STORY, "max_tokens": 48, "ignore_eos": False,  # a 24-token document, then EOS
                "response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}},
}


def test_a_killed_decode_worker_s_streams_go_on_after_its_restart(server, default_model_dir, tokenizer):
    """Every stream goes on from its last token on the restarted decode worker, as if nothing
    happened: greedy, with a presence penalty (it counts the tokens before the death), seeded
    (it draws on from there) and under a grammar (it reads them first)."""
    srv, _ = server
    expected = {}
    for kind, body in RESUMED.items():
        reference = httpx.post(f"{srv.v1}/chat/completions", json={"model": MODEL, **body}, timeout=120)
        assert reference.status_code == 200, reference.text
        expected[kind] = reference.json()["choices"][0]["message"]["content"]
    retries = retries_counted(srv)
    streams = {kind: Streams(f"{srv.v1}/chat/completions", body, 2 if kind == "greedy" else 1)
               for kind, body in RESUMED.items()}
    for s in streams.values():
        s.wait_started()
    os.kill(worker_pid(srv, "decode"), signal.SIGKILL)
    killed = time.monotonic()
    ends = {kind: s.join() for kind, s in streams.items()}
    for kind, runs in ends.items():
        for end in runs:
            end.assert_clean()
            assert end.done, (kind, end.error)
            assert end.ended_at > killed  # it was interrupted: it went on after the death
            assert end.text == expected[kind] or (kind == "greedy" and chat_near_tie(
                default_model_dir, tokenizer, STORY["messages"], end.text, expected[kind])), (kind, end.text)
    assert retries_counted(srv) == retries + 5  # each stream went on elsewhere, once
    back = max(e.ended_at for runs in ends.values() for e in runs) - killed
    assert srv.proc.poll() is None
    wait_until("every KV block is free again", lambda: pools_full(srv), 10, 0.2)
    print(f"decode killed: 5/5 streams (greedy, penalized, seeded, constrained) went on and ended [DONE] "
          f"{back:.1f} s after the kill")


def retries_counted(srv: Server) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    found = re.search(r"^pdserve:request_retries_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def timeout_aborts(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text  # /metrics does not renew the lease
    found = re.search(r'^pdserve:aborts_total\{[^}]*origin="timeout"[^}]*\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_silent_router_loses_its_requests_after_the_lease(server):
    """The workers abort a silent router's requests once its lease runs out. That is a worker
    failing them: when the router runs again, the streams go on from their last token."""
    srv, _ = server
    decode_url = router_health(srv)["decode"]["url"]
    before = timeout_aborts(decode_url)
    retries = retries_counted(srv)
    # 1,000 tokens: here ≈ 400 are out when the lease ends (≈ 60 a second each), so the rest,
    # decoded once the router runs again, is not most of the test's time
    streams = Streams(f"{srv.v1}/chat/completions", {**STORY, "max_tokens": 1000, "presence_penalty": 0.5}, 2)
    streams.wait_started()
    os.kill(srv.proc.pid, signal.SIGSTOP)  # the router (and the launcher): its connections stay open
    stopped = time.monotonic()
    try:
        wait_until("the decode worker aborts both streams", lambda: timeout_aborts(decode_url) >= before + 2,
                   LEASE_S + 5, 0.2)
        took = time.monotonic() - stopped
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    assert LEASE_S - 1.0 <= took < LEASE_S + 5  # its last probe came up to a probe interval (0.5 s) before
    ends = streams.join()
    assert all(e.done for e in ends), [e.error for e in ends]
    assert retries_counted(srv) == retries + 2
    wait_until("every KV block is free again", lambda: pools_full(srv), 10, 0.2)
    print(f"router stopped: its 2 requests aborted by the workers {took:.1f} s later (lease {LEASE_S:g} s); "
          "both went on once it ran again")


def test_a_crash_loop_ends_serve_with_the_workers_error_in_one_line(server):
    srv, link = server
    link.unlink()  # every restart of a worker now fails at once, in its start-up check
    os.kill(worker_pid(srv, "prefill"), signal.SIGKILL)
    code = srv.proc.wait(timeout=60)
    last = srv.log[-1]
    assert code == 1
    assert last.startswith("pdserve: the prefill worker keeps failing"), last
    assert f"the model directory {link} does not exist" in last


def test_tp_that_does_not_split_the_heads_is_one_line_in_under_3s():
    started = time.monotonic()
    proc = subprocess.run([*serve_command(), "--tp", "2", "--port", "0"], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pdserve serve: error: --tp 2 does not divide the 9 attention heads of the model (LlamaForCausalLM): "
        "use a TP size that divides 9 (1, 3, 9)"]
    assert took < 3.0
