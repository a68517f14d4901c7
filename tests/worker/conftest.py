"""Real worker processes on loopback, and a small client of their internal API (worker/API.md)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
import pytest

from pdserve import worker_api as api
from pdserve.ports import free_port  # noqa: F401  (tests import it from here)

os.environ.setdefault("UCX_NET_DEVICES", "lo")


@dataclass
class WorkerProc:
    role: str
    url: str
    proc: subprocess.Popen
    worker_id: str
    log: str = ""  # the file its stderr goes to

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **kw)

    def wait_ready(self, timeout: float = 180) -> WorkerProc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} worker exited: {open(self.log).read()[-3000:]}")
            try:
                if self.get("/ready").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"{self.role} worker did not become ready")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def start_worker(role: str, model: str, *extra: str, worker_id: str | None = None,
                 timeout: float = 180, wait: bool = True, log_level: str = "WARNING") -> WorkerProc:
    """`pdserve worker --role ROLE` in its own session; with `wait`, once its /ready says so."""
    port = free_port()
    worker_id = worker_id or f"test-{role}-{port}"
    cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", log_level,
           "worker", "--role", role, "--model", model, "--port", str(port), "--worker-id", worker_id,
           "--threads", "1", *extra]
    # the log goes to a file: an undrained pipe would block the worker once it fills up
    log = tempfile.NamedTemporaryFile(prefix=f"pdserve-{role}-{port}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=log)
    w = WorkerProc(role, f"http://127.0.0.1:{port}", proc, worker_id, log.name)
    return w.wait_ready(timeout) if wait else w


def ready(*workers: WorkerProc, timeout: float = 180) -> tuple[WorkerProc, ...]:
    """Wait for workers started with `wait=False` (their start-ups overlap); kill them all if one
    fails to come up."""
    try:
        for w in workers:
            w.wait_ready(timeout)
    except BaseException:
        for w in workers:
            w.kill()
        raise
    return workers


def stop_all(*workers: WorkerProc) -> None:
    """`stop()` every worker, their drains overlapping: SIGTERM to all, then wait for each."""
    for w in workers:
        if w.proc.poll() is None:
            os.killpg(w.proc.pid, signal.SIGTERM)
    for w in workers:
        try:
            w.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            w.kill()


class PDClient:
    """The router's PD flow, done by hand with the contract's messages (pdserve.worker_api):
    decode allocates the room, prefill sends the KV."""

    def __init__(self, prefill: WorkerProc | None, decode: WorkerProc, keep_prefills: bool = False):
        self.prefill, self.decode = prefill, decode
        # keep_prefills: a /prefill call outlives its decode stream (not cancelled when it breaks);
        # `prefill_errors` has each failed call's (status, error code), or (0, exception name) when
        # the prefill worker could not be reached. (A task's exception nobody retrieves is logged
        # when the task is collected, from whatever code runs then: keep them all retrieved.)
        self.keep_prefills = keep_prefills
        self.prefills: list[asyncio.Task] = []
        self.prefill_errors: dict[str, tuple[int, str]] = {}
        self.last_lines: dict[str, api.TokenLine] = {}  # each request's final line
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, pool=None),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def generate(self, rid: str, prompt_ids: list[int], params: dict) -> tuple[list[int], str, str | None]:
        """(tokens, finish reason, error) of one request; `params`: SamplingParams fields."""
        body = api.GenerateRequest(request_id=rid, prompt_ids=prompt_ids, params=api.SamplingParams(**params))
        if self.prefill is not None:
            body.prefill_url, body.prefill_worker_id = self.prefill.url, self.prefill.worker_id
        tokens: list[int] = []
        prefill_task = None
        try:  # X-Request-Id as the router sends it: the room id
            async with self.http.stream("POST", self.decode.url + "/generate", json=body.wire(),
                                        headers={"X-Request-Id": rid}) as r:
                assert r.status_code == 200, await r.aread()
                async for text in r.aiter_lines():
                    msg = api.parse_line(text)
                    if isinstance(msg, api.RoomLine):  # blocks allocated: prefill writes into them, concurrently
                        prefill_task = asyncio.create_task(self._prefill(body, msg.room))
                        self.prefills.append(prefill_task)
                        continue
                    tokens += msg.token_ids
                    if msg.finish_reason is not None:
                        self.last_lines[rid] = msg
                        return tokens, msg.finish_reason.value, msg.error
        finally:
            if prefill_task is not None and not prefill_task.done() and not self.keep_prefills:
                prefill_task.cancel()
        raise AssertionError("stream ended without a finish_reason")

    async def _prefill(self, req: api.GenerateRequest, room: api.Room) -> None:
        body = api.PrefillRequest(request_id=req.request_id, prompt_ids=req.prompt_ids, params=req.params,
                                  decode=api.DecodeTarget(worker_id=room.worker_id, decode_url=self.decode.url,
                                                          blocks=room.blocks, cached_blocks=room.cached_blocks))
        try:
            r = await self.http.post(self.prefill.url + "/prefill", headers={"X-Request-Id": req.request_id},
                                     json=body.wire())
        except httpx.TransportError as e:  # the prefill worker died: recorded, never left unretrieved
            self.prefill_errors[req.request_id] = (0, type(e).__name__)
            return
        if r.status_code != 200:  # a failed prefill is an error status (ErrorBody)
            self.prefill_errors[req.request_id] = (r.status_code, r.json()["error"]["code"])
            try:
                await self.abort(req.request_id)
            except httpx.TransportError:  # the decode worker is dead: nothing there to abort
                pass

    async def abort(self, rid: str, origin: str | None = None) -> None:
        body = api.AbortRequest(request_id=rid, **({"origin": origin} if origin else {}))
        for w in (self.prefill, self.decode):
            if w is not None:
                await self.http.post(w.url + "/abort", json=body.wire(), headers={"X-Request-Id": rid})


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def pool_full(w: WorkerProc) -> bool:
    load = w.get("/load").json()
    return load["free_blocks"] == load["total_blocks"] and load["in_flight"] == 0


@pytest.fixture(scope="module")
def pd_pair(default_model_dir):
    prefill, decode = ready(start_worker("prefill", default_model_dir, wait=False),
                            start_worker("decode", default_model_dir, wait=False))
    yield prefill, decode
    stop_all(prefill, decode)
