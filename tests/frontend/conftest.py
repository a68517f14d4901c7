"""Router fixtures: the real tokenizer, an in-process router with no workers behind it, and (for
the e2e tests) `pdserve serve --mode pd` started once per session on loopback."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.frontend.app import create_app
from pdserve.frontend.config import RouterConfig
from pdserve.ports import free_port  # noqa: F401  (tests import it from here)
from pdserve.tokenizer import Tokenizer

from tests.frontend.router_cases import API_KEY

SERVE_MAX_BODY = 1 << 20
SERVE_STARTUP_S = 300


def children_of(pid: int) -> list[int]:
    """The pids whose parent is `pid`, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: str) -> Tokenizer:
    return Tokenizer(default_model_dir)


def router_config(model_dir: str, **overrides) -> RouterConfig:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there
    fields = {"model_dir": Path(model_dir), "served_model_name": "SmolLM2-135M-Instruct",
              "aliases": ("default",), "prefill_urls": dead[:1], "decode_urls": dead[1:],
              "api_key": API_KEY, "max_request_bytes": 64 << 10, **overrides}
    return RouterConfig(**fields)


@pytest.fixture
def no_worker_client(default_model_dir: str, tokenizer: Tokenizer) -> Iterator:
    """A TestClient of a router whose workers are all down."""
    from fastapi.testclient import TestClient

    with TestClient(create_app(router_config(default_model_dir), tokenizer)) as client:
        yield client


@dataclass
class Server:
    url: str          # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log: deque        # the last lines of its output (all of it is in log_path)
    log_path: Path | None = None

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def workers(self) -> dict[str, str]:
        """role → URL, from the router's /health."""
        body = httpx.get(f"{self.url}/health", timeout=10).json()
        return {w["role"]: w["url"] for w in body["workers"]}


def serve_command() -> list[str]:
    """`pdserve serve` (pdserve.cli once it registers serve; the same code via pdserve.launcher)."""
    from pdserve import cli

    try:
        cli.build_parser().parse_args(["serve", "--help"])
    except SystemExit as e:  # --help exits 0 when the subcommand exists, 2 when not
        if e.code == 0:
            return [sys.executable, "-m", "pdserve.cli", "--log-level", "INFO", "serve"]
    return [sys.executable, "-m", "pdserve.launcher"]


def start_server(*flags: str, timeout_s: float = SERVE_STARTUP_S, log_path: Path | None = None) -> Server:
    port = free_port()
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    cmd = [*serve_command(), "--port", str(port), "--threads", "1", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    log: deque = deque(maxlen=400)
    ready = threading.Event()

    def relay() -> None:
        sink = log_path.open("w", encoding="utf-8") if log_path else None
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            log.append(line)
            if sink:
                sink.write(line + "\n")
                sink.flush()
            if re.search(r"pdserve: serving .* at http://", line):
                ready.set()

    threading.Thread(target=relay, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError("pdserve serve did not start:\n" + "\n".join(list(log)[-60:]))
    return Server(f"http://127.0.0.1:{port}", proc, log, log_path)


def stop_server(proc: subprocess.Popen, timeout_s: float = 30) -> int | None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return proc.returncode


@pytest.fixture(scope="session")
def pd_server(tmp_path_factory) -> Iterator[Server]:
    """`pdserve serve --mode pd` with an API key and a 1 MiB body limit, shared by the e2e tests.
    Its whole output goes to serve.log in the session's temporary directory."""
    log_path = tmp_path_factory.mktemp("pd-server") / "serve.log"
    server = start_server("--mode", "pd", "--api-key", API_KEY, "--max-request-bytes", str(SERVE_MAX_BODY),
                          log_path=log_path)
    yield server
    stop_server(server.proc)
