"""Router operations without a model: liveness vs readiness, /v1/models only when ready, the
drain (503 + Retry-After for new requests, in-flight ones finish or end with an error event,
their rooms aborted with origin "drain"), worker discovery by DNS, the API key sources, JSON
logs carrying the X-Request-Id, and the router's Prometheus metrics.

Workers here are `FakeWorker`s: the worker HTTP API (API.md) on loopback, with a health status
set by the test and one token every `token_s` seconds, so every case runs in about a second."""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from pdserve import worker_api as api
from pdserve.frontend.app import create_app
from pdserve.frontend.cli import api_key
from pdserve.frontend.discovery import Discovery, parse_target
from pdserve.frontend.workers import WorkerPool
from pdserve.logs import JSONFormatter, RequestIdFilter
from pdserve.worker_api import Role

from tests.frontend.conftest import free_port, router_config
from tests.frontend.router_cases import CHAT, chat

pytestmark = pytest.mark.timeout(120)

TOKEN = 1000  # any ordinary token id of SmolLM2's vocabulary


class FakeWorker:
    """A worker's API on 127.0.0.1 without a model; /generate streams `max_tokens` tokens."""

    def __init__(self, role: str, token_s: float = 0.02) -> None:
        self.role = role
        self.token_s = token_s
        self.status = "ok"              # /health's status: 200 when "ok", else 503
        self.aborts: list[dict] = []    # /abort bodies, in order
        self.prefill_error: api.ErrorCode | None = None  # /prefill fails with this code
        self.decode_error: api.TokenLine | None = None   # /generate ends with this line after the room
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self._app(), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def _app(self) -> FastAPI:
        app = FastAPI()
        aborted: set[str] = set()

        @app.get("/health")
        async def health():
            body = api.Health(status=self.status, role=self.role, step=0, seconds_since_step=0.0)
            return JSONResponse(body.wire(), status_code=200 if self.status == "ok" else 503)

        @app.get("/info")
        async def info():
            return api.Info(role=self.role, worker_id=f"fake-{self.role}-{self.port}", model="fake",
                            max_model_len=2048, block_size=16, num_blocks=64, tp=1, eos_token_ids=[]).wire()

        @app.get("/load")
        async def load():
            return api.Load(free_blocks=64, total_blocks=64).wire()

        @app.post("/abort")
        async def abort(request: Request):
            body = api.AbortRequest.model_validate(await request.json())
            self.aborts.append(body.wire())
            aborted.add(body.request_id)
            return api.AbortResult(aborted=True).wire()

        @app.post("/prefill")
        async def prefill(request: Request):
            api.PrefillRequest.model_validate(await request.json())
            if self.prefill_error is not None:
                error = api.ErrorBody.of(self.prefill_error, "the KV transfer failed")
                return JSONResponse(error.wire(), status_code=self.prefill_error.status)
            return api.PrefillDone().wire()

        @app.post("/generate")
        async def generate(request: Request):
            body = api.GenerateRequest.model_validate(await request.json())
            rid, n = body.request_id, body.params.max_tokens

            async def lines():
                if body.prefill_url is not None:  # a decode worker: the room's blocks first
                    yield api.line(api.RoomLine(room=api.Room(request_id=rid, blocks=[0, 1], worker_id=self.role)))
                if self.decode_error is not None:
                    yield api.line(self.decode_error)
                    return
                for i in range(n):
                    await asyncio.sleep(self.token_s)  # the fake model's pace, not a synchronization
                    if rid in aborted:
                        yield api.line(api.TokenLine(finish_reason=api.FinishReason.ABORT))
                        return
                    reason = api.FinishReason.LENGTH if i == n - 1 else None
                    yield api.line(api.TokenLine(token_ids=[TOKEN], finish_reason=reason))

            return StreamingResponse(lines(), media_type=api.NDJSON)

        return app

    def __enter__(self) -> FakeWorker:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def ops_config(model_dir: str, **overrides):
    fields = {"prefill_urls": [], "decode_urls": [], "api_key": None, "health_interval_s": 0.1,
              "dead_after_s": 0.5, **overrides}
    return router_config(model_dir, **fields)


async def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def run_with_router(config, tokenizer, scenario) -> None:
    """Run `scenario(http, router)` against the app (lifespan started) in one event loop."""
    async def main() -> None:
        app = create_app(config, tokenizer)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                         timeout=30) as http:
                await scenario(http, app.state.router)
    asyncio.run(main())


def sse_events(text: str) -> list:
    return [block[6:] if block == "data: [DONE]" else json.loads(block[6:])
            for block in text.split("\n\n") if block.startswith("data: ")]


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(fams: dict, family: str, suffix: str = "", **labels: str) -> float:
    hits = [s.value for s in fams[family].samples
            if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (family, suffix, labels)
    return hits[0]


# ---- liveness and readiness ----------------------------------------------------------------------


def test_health_stays_200_while_ready_follows_the_workers(default_model_dir, tokenizer):
    with FakeWorker("prefill") as prefill, FakeWorker("decode") as decode:
        config = ops_config(default_model_dir, prefill_urls=[prefill.url], decode_urls=[decode.url])

        async def scenario(http: httpx.AsyncClient, router) -> None:
            assert (await http.get("/ready")).status_code == 200
            models = await http.get("/v1/models")
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
            decode.status = "failed"
            await wait_until(lambda: not router.ready, 3, "the router to see the decode worker fail")
            ready = await http.get("/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "no workers"
            assert {w["role"]: w["available"] for w in ready.json()["workers"]} == {"prefill": True, "decode": False}
            health = await http.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"  # liveness: the router's own
            models = await http.get("/v1/models")
            assert models.status_code == 503 and models.headers["retry-after"]
            decode.status = "ok"
            await wait_until(lambda: router.ready, 3, "the decode worker back")
            assert (await http.get("/v1/models")).status_code == 200

        run_with_router(config, tokenizer, scenario)


@pytest.mark.parametrize("code,status", [(api.ErrorCode.PREFILL_FAILED, 500), (api.ErrorCode.DECODE_UNREACHABLE, 503)])
def test_a_failed_prefill_names_it_aborts_the_room_on_both_workers_and_says_whether_to_retry(
        default_model_dir, tokenizer, code, status):
    """A fault of the prefill itself is a 500. The decode worker gone (it died under the KV
    transfer, or never answered /bootstrap) is a worker that died under the request, as when its
    stream breaks: 503 with Retry-After, so the client may retry."""
    with FakeWorker("prefill") as prefill, FakeWorker("decode") as decode:
        prefill.prefill_error = code
        config = ops_config(default_model_dir, prefill_urls=[prefill.url], decode_urls=[decode.url])

        async def scenario(http: httpx.AsyncClient, router) -> None:
            r = await http.post(CHAT, json=chat(max_tokens=1000), headers={"X-Request-Id": "pf-1"})
            assert r.status_code == status, r.text
            assert ("retry-after" in r.headers) == (status == 503)
            assert r.json()["error"]["message"] == "prefill failed: the KV transfer failed"
            await wait_until(lambda: decode.aborts and prefill.aborts, 3, "the aborts to reach both workers")
            assert decode.aborts == prefill.aborts == [{"request_id": "pf-1", "origin": "peer"}]

        run_with_router(config, tokenizer, scenario)


@pytest.mark.parametrize("peer_dead,status", [(False, 500), (True, 503)])
def test_a_room_that_failed_on_the_decode_worker_says_whether_to_retry(default_model_dir, tokenizer,
                                                                      peer_dead, status):
    """The decode side of the same rule: its room failed because the prefill worker died (503,
    retry), or for a fault of its own (500)."""
    with FakeWorker("prefill") as prefill, FakeWorker("decode") as decode:
        decode.decode_error = api.TokenLine(finish_reason=api.FinishReason.ERROR, peer_dead=peer_dead,
                                            error="KV transfer failed: rank 0: source gone")
        config = ops_config(default_model_dir, prefill_urls=[prefill.url], decode_urls=[decode.url])

        async def scenario(http: httpx.AsyncClient, router) -> None:
            r = await http.post(CHAT, json=chat(max_tokens=1000), headers={"X-Request-Id": "df-1"})
            assert r.status_code == status, r.text
            assert ("retry-after" in r.headers) == (status == 503)
            assert r.json()["error"]["message"] == "KV transfer failed: rank 0: source gone"

        run_with_router(config, tokenizer, scenario)


def test_health_fails_when_the_event_loop_stalls(default_model_dir, tokenizer):
    with FakeWorker("both") as worker:
        config = ops_config(default_model_dir, worker_urls=[worker.url], loop_stall_s=0.5)

        async def scenario(http: httpx.AsyncClient, router) -> None:
            assert (await http.get("/health")).status_code == 200
            time.sleep(1.0)  # blocks the loop, as a runaway handler would
            r = await http.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "stalled"
            deadline = time.monotonic() + 3  # a stall is reported for `loop_stall_s` after it ended, then not
            while (await http.get("/health")).status_code != 200:
                assert time.monotonic() < deadline, "/health did not recover after the stall"
                await asyncio.sleep(0.05)

        run_with_router(config, tokenizer, scenario)


# ---- drain ---------------------------------------------------------------------------------------


def test_drain_refuses_new_requests_finishes_short_ones_and_stops_long_ones(default_model_dir, tokenizer):
    records: list[logging.LogRecord] = []
    with FakeWorker("both") as worker, captured_logs(records):
        config = ops_config(default_model_dir, worker_urls=[worker.url])

        async def stream(http: httpx.AsyncClient, rid: str, max_tokens: int) -> list:
            r = await http.post(CHAT, json=chat(stream=True, max_tokens=max_tokens), headers={"X-Request-Id": rid})
            assert r.status_code == 200
            return sse_events(r.text)

        async def scenario(http: httpx.AsyncClient, router) -> None:
            short = [asyncio.create_task(stream(http, f"short-{i}", 10)) for i in range(4)]
            long = [asyncio.create_task(stream(http, f"long-{i}", 1500)) for i in range(4)]
            await wait_until(lambda: len(router.calls) == 8, 5, "8 streams in flight")
            started = time.monotonic()
            drain = asyncio.create_task(router.drain(1.0))
            await wait_until(lambda: router.draining, 2, "the drain to begin")
            refused = await http.post(CHAT, json=chat())
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
            assert refused.json()["error"]["code"] == "service_unavailable"
            assert (await http.get("/ready")).status_code == 503
            health = await http.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "draining"
            for events in await asyncio.gather(*short):
                assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
            for events in await asyncio.gather(*long):
                assert "[DONE]" not in events
                assert events[-1]["error"]["code"] == "service_unavailable", events[-1]
            await drain
            assert time.monotonic() - started < 1.0 + 1.0
            assert router.active == 0 and not router.calls

            stopped = sorted(a["request_id"] for a in worker.aborts)
            assert stopped == [f"long-{i}" for i in range(4)]
            assert {a["origin"] for a in worker.aborts} == {"drain"}
            f = families((await http.get("/metrics")).text)
            router_labels = {"model_name": "SmolLM2-135M-Instruct", "role": "router"}
            assert sample(f, "pdserve:aborts", "_total", origin="drain", **router_labels) == 4
            assert sample(f, "pdserve:request_success", "_total", finished_reason="abort") == 4
            assert sample(f, "pdserve:request_success", "_total", finished_reason="length") == 4
            assert sample(f, "pdserve:num_requests_running") == sample(f, "pdserve:num_requests_waiting") == 0
            assert sample(f, "pdserve:e2e_request_latency_seconds", "_count") == 8

        run_with_router(config, tokenizer, scenario)
    about_requests = [r for r in records if r.name in ("pdserve.frontend.choices", "pdserve.frontend.requests",
                                                       "pdserve.access")]
    assert {r.name for r in about_requests} == {"pdserve.frontend.choices", "pdserve.frontend.requests",
                                                "pdserve.access"}
    for r in about_requests:  # every line about a request carries its X-Request-Id
        assert r.request_id, r.getMessage()
        if r.name != "pdserve.access":
            assert f"[{r.request_id}]" in r.getMessage()
    assert {r.request_id for r in about_requests if "aborting" in r.getMessage()} == {f"long-{i}" for i in range(4)}


@contextmanager
def logs_to(handler: logging.Handler) -> Iterator[None]:
    """pdserve's INFO records, with their request ids, go to `handler` inside the block."""
    handler.addFilter(RequestIdFilter())
    log = logging.getLogger("pdserve")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


@contextmanager
def captured_logs(records: list[logging.LogRecord]) -> Iterator[None]:
    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    with logs_to(Keep()):
        yield


def test_a_stop_string_aborts_the_room_with_origin_router(default_model_dir, tokenizer):
    with FakeWorker("both") as worker:
        config = ops_config(default_model_dir, worker_urls=[worker.url])

        async def scenario(http: httpx.AsyncClient, router) -> None:
            r = await http.post(CHAT, json=chat(max_tokens=50, stop=[")("]), headers={"X-Request-Id": "stop-1"})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
            await wait_until(lambda: worker.aborts, 3, "the abort to reach the worker")
            assert worker.aborts == [{"request_id": "stop-1", "origin": "router"}]
            f = families((await http.get("/metrics")).text)
            assert sample(f, "pdserve:aborts", "_total", origin="router") == 1
            assert sample(f, "pdserve:request_success", "_total", finished_reason="stop") == 1
            assert sample(f, "pdserve:generation_tokens", "_total") == 2  # "()" then "(": stop

        run_with_router(config, tokenizer, scenario)


# ---- discovery -----------------------------------------------------------------------------------


class Busy:
    """A request in flight on a worker (what a ChoiceRun is to the pool)."""

    def fail(self, error) -> None:
        raise AssertionError("a retired worker's requests must finish, not fail")


def test_discovered_workers_join_and_retire_once_idle():
    pool = WorkerPool(None, [], [], [])
    source = "decode-headless:8200"
    pool.sync(source, Role.DECODE, ["http://10.0.0.1:8200", "http://10.0.0.2:8200"])
    assert [w.url for w in pool.workers] == ["http://10.0.0.1:8200", "http://10.0.0.2:8200"]
    first, second = pool.workers
    first.inflight.add(Busy())
    pool.sync(source, Role.DECODE, ["http://10.0.0.2:8200", "http://10.0.0.3:8200"])
    assert first.retired and not first.available and first in pool.workers  # its request goes on
    assert [w.url for w in pool.workers] == ["http://10.0.0.1:8200", "http://10.0.0.2:8200", "http://10.0.0.3:8200"]
    first.inflight.clear()
    pool.sync(source, Role.DECODE, ["http://10.0.0.2:8200", "http://10.0.0.3:8200"])
    assert [w.url for w in pool.workers] == ["http://10.0.0.2:8200", "http://10.0.0.3:8200"]
    assert second.source == source and not second.retired


def test_a_resolver_failure_keeps_the_workers_and_no_such_name_empties_them():
    pool = WorkerPool(None, [], [], [])
    answers: dict[str, object] = {"prefill-headless": ["10.0.0.7"]}

    async def resolve(host: str, port: int) -> list[str]:
        answer = answers[host]
        if isinstance(answer, Exception):
            raise answer
        return answer

    discovery = Discovery(pool, [parse_target(Role.PREFILL, "prefill-headless:8100")], resolve=resolve)
    asyncio.run(discovery.refresh())
    assert [(w.url, w.role) for w in pool.workers] == [("http://10.0.0.7:8100", Role.PREFILL)]
    answers["prefill-headless"] = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    asyncio.run(discovery.refresh())
    assert [w.retired for w in pool.workers] == [False]
    answers["prefill-headless"] = []
    asyncio.run(discovery.refresh())
    assert pool.workers == []


@pytest.mark.parametrize("text", ["svc", "svc:", ":8100", "svc:http", "svc:70000"])
def test_a_discovery_target_is_name_colon_port(text):
    with pytest.raises(ValueError):
        parse_target(Role.DECODE, text)


def test_the_router_finds_its_workers_by_dns(default_model_dir, tokenizer):
    with FakeWorker("both") as worker:
        config = ops_config(default_model_dir, discover_worker=[f"localhost:{worker.port}"], discover_interval_s=0.2)

        async def scenario(http: httpx.AsyncClient, router) -> None:
            ready = await http.get("/ready")
            assert ready.status_code == 200
            assert [w["url"] for w in ready.json()["workers"]] == [f"http://127.0.0.1:{worker.port}"]
            r = await http.post(CHAT, json=chat(max_tokens=3))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

        run_with_router(config, tokenizer, scenario)


# ---- API key and logs ----------------------------------------------------------------------------


def test_the_api_key_comes_from_the_flag_then_the_file_then_the_environment(tmp_path: Path, monkeypatch):
    key_file = tmp_path / "api-key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    args = argparse.Namespace(api_key="from-flag", api_key_file=str(key_file))
    assert api_key(args) == "from-flag"
    args.api_key = None
    assert api_key(args) == "from-file"
    args.api_key_file = None
    assert api_key(args) == "from-env"
    monkeypatch.setenv("PDSERVE_API_KEY", "")
    assert api_key(args) is None
    key_file.write_text("  \n")
    with pytest.raises(SystemExit, match="empty"):
        api_key(argparse.Namespace(api_key=None, api_key_file=str(key_file)))


def test_json_logs_carry_the_request_id_and_the_probes_are_not_logged(no_worker_client):
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JSONFormatter("router"))
    with logs_to(handler):
        for path in ("/health", "/ready", "/metrics"):
            no_worker_client.get(path)
        no_worker_client.post(CHAT, json=chat(), headers={"X-Request-Id": "req-42", "Authorization": "Bearer test-key"})
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    access = [line for line in lines if line["logger"] == "pdserve.access"]
    assert [a["http"]["path"] for a in access] == [CHAT]  # no line for the probes and the scrape
    assert access[0]["request_id"] == "req-42" and access[0]["http"]["status"] == 503
    assert access[0]["component"] == "router" and access[0]["level"] == "INFO" and access[0]["ts"].endswith("Z")
    assert all(line.get("request_id") == "req-42" for line in lines if "req-42" in line["message"])


def test_pdserve_router_drains_on_sigterm_and_exits_zero(tmp_path: Path):
    """The command itself: --api-key-file, --log-json, --drain-timeout; a stream still running
    at the drain timeout ends with an error event and its room is aborted on the worker."""
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    with FakeWorker("both", token_s=0.05) as worker:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "router", "--worker", worker.url,
                                 "--port", str(port), "--api-key-file", str(key_file), "--drain-timeout", "1",
                                 "--log-json"], stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        try:
            deadline = time.monotonic() + 60
            while not _answers(f"{url}/ready"):
                assert proc.poll() is None and time.monotonic() < deadline, "the router did not get ready"
                time.sleep(0.1)
            auth = {"Authorization": "Bearer s3cret", "X-Request-Id": "drained-1"}
            assert httpx.get(f"{url}/v1/models").status_code == 401
            with httpx.Client(timeout=30) as http, http.stream(
                    "POST", f"{url}{CHAT}", json=chat(max_tokens=1000, stream=True), headers=auth) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                sent = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                while _answers(f"{url}/ready"):  # until the signal is handled
                    assert time.monotonic() - sent < 5
                    time.sleep(0.02)
                refused = httpx.get(f"{url}/v1/models", headers=auth)
                events = [line[6:] for line in lines if line.startswith("data: ")]
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert json.loads(events[-1])["error"]["code"] == "service_unavailable"
            assert proc.wait(timeout=20) == 0 and time.monotonic() - sent < 1 + 5
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert worker.aborts == [{"request_id": "drained-1", "origin": "drain"}]
    logs = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
    assert [x["message"] for x in logs if x["logger"] == "pdserve.frontend.server"][-1] == "drained: no request in flight"
    about = [x for x in logs if "drained-1" in x["message"] or x.get("request_id") == "drained-1"]
    assert about and all(x.get("request_id") == "drained-1" for x in about)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
