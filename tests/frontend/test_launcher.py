"""`pdserve serve` as a process: colocated mode serves what PD serves, shutdown leaves no process
behind (SIGTERM, and SIGKILL of the launcher itself), a worker failing at start-up is reported,
and the router's port is held while the workers start."""
from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import openai
import pytest

from tests.frontend.conftest import children_of, free_port, serve_command, start_server, stop_server
from tests.frontend.router_cases import API_KEY
from tests.served_reference import chat_near_tie

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

MODEL = "SmolLM2-135M-Instruct"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def greedy(base_url: str, prompt: str, api_key: str = "none") -> str:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=10, temperature=0)
    return r.choices[0].message.content


def test_colocated_matches_pd_and_sigterm_leaves_no_process(pd_server, default_model_dir, tokenizer):
    """Colocated answers as PD does, or parts from it only at a near-tie of the served model. The
    second token of "Say hello." is one (" there" and "!" 5.5e-4 apart in the reference): a server
    that answered the prompt before computes only its last token from the cache, and lands on the
    other side of the tie than a server that computes the whole prompt (measured in the engine)."""
    server = start_server("--mode", "colocated")
    workers = children_of(server.proc.pid)
    try:
        assert len(workers) == 1 and set(server.workers()) == {"both"}
        for prompt in ("What is the capital of France?", "Say hello."):
            ours, pd = greedy(server.v1, prompt), greedy(pd_server.v1, prompt, API_KEY)
            user = [{"role": "user", "content": prompt}]
            assert ours == pd or chat_near_tie(default_model_dir, tokenizer, user, ours, pd), (prompt, ours, pd)
    finally:
        code = stop_server(server.proc)
    assert code == 0, "\n".join(server.log)
    assert wait_gone(workers, 5) == []


def test_killing_the_launcher_takes_its_workers_along():
    server = start_server("--mode", "pd")
    workers = children_of(server.proc.pid)
    assert len(workers) == 2
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)
    left = wait_gone(workers, 15)
    for pid in left:  # do not leave them to the rest of the suite
        os.killpg(pid, signal.SIGKILL)
    assert left == []


def test_a_worker_failing_at_startup_is_reported_and_serve_exits_1():
    cmd = [*serve_command(), "--port", "1", "--mode", "colocated", "--worker-arg=--no-such-flag"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, start_new_session=True)
    assert proc.returncode == 1
    assert "exited with code" in proc.stderr and "--no-such-flag" in proc.stderr


def test_the_routers_port_is_held_while_the_workers_start():
    """Workers and their TP rendezvous take free ports from the range tests (and users) take the
    router's from: serve binds the router's port before it starts a worker, so none can take it
    (a CI run once saw its prefill worker get the router's port, and serve fail to bind)."""
    port = free_port()
    cmd = [*serve_command(), "--port", str(port), "--mode", "colocated"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    try:
        seen = []
        for line in proc.stdout:  # the worker's pool comes before it listens, and long before serving
            seen.append(line)
            if "KV pool:" in line:
                break
        assert not any("pdserve: serving" in line for line in seen), "".join(seen)
        with socket.socket() as probe, pytest.raises(OSError) as taken:
            probe.bind(("127.0.0.1", port))  # as ports.free_port tries a port
        assert taken.value.errno == errno.EADDRINUSE
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
