"""HTTP calls from the router to workers (worker_api.md), on two shared httpx clients.

``streams`` carries /generate and /prefill: no read deadline (a long prompt may queue), a
connect deadline, no connection cap. ``control`` carries /health, /load, /info and /abort with
short deadlines on a separate pool, so probes and aborts never queue behind busy streams.
Neither trusts proxy settings from the environment: workers are reached directly.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

logger = logging.getLogger(__name__)


class WorkerError(Exception):
    """A worker could not serve one request (refused, unreachable, failed, or broke the protocol)."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass
class Probe:
    """One /health answer: alive (answered), and whether it takes new requests."""

    answered: bool
    status: str            # "ok" | "draining" | "wedged" | ... | "unreachable" | "refused"
    step: int | None = None

    @property
    def ok(self) -> bool:
        return self.answered and self.status == "ok"


@dataclass
class WorkerLoad:
    waiting: int = 0
    running: int = 0
    transferring: int = 0
    free_blocks: int = 0
    total_blocks: int = 0

    @property
    def queued(self) -> int:
        return self.waiting + self.running + self.transferring


class WorkerClient:
    def __init__(self, connect_timeout_s: float = 3.0, control_timeout_s: float = 2.0) -> None:
        self.streams = httpx.AsyncClient(
            trust_env=False,
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.control = httpx.AsyncClient(
            trust_env=False,
            timeout=httpx.Timeout(control_timeout_s),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
        )

    async def aclose(self) -> None:
        await self.streams.aclose()
        await self.control.aclose()

    # ---- control --------------------------------------------------------------------------------

    async def health(self, url: str, timeout_s: float) -> Probe:
        try:
            r = await self.control.get(f"{url}/health", timeout=timeout_s)
        except httpx.ConnectError:
            return Probe(False, "refused")
        except httpx.HTTPError:
            return Probe(False, "unreachable")
        try:
            body = r.json()
        except ValueError:
            body = {}
        status = body.get("status") if isinstance(body, dict) else None
        if r.status_code == 200:
            return Probe(True, status or "ok", body.get("step"))
        return Probe(True, status or f"http {r.status_code}")

    async def load(self, url: str, timeout_s: float) -> WorkerLoad | None:
        body = await self._get_json(url, "/load", timeout_s)
        if body is None:
            return None
        fields = WorkerLoad.__dataclass_fields__
        return WorkerLoad(**{k: int(v) for k, v in body.items() if k in fields})

    async def info(self, url: str, timeout_s: float) -> dict[str, Any] | None:
        return await self._get_json(url, "/info", timeout_s)

    async def abort(self, url: str, request_id: str, timeout_s: float, origin: str | None = None) -> bool:
        """POST /abort; idempotent on the worker, best effort here (a dead worker is fine).
        `origin` says who asked (a worker may count it; older ones ignore it)."""
        body = {"request_id": request_id, **({"origin": origin} if origin else {})}
        try:
            r = await self.control.post(f"{url}/abort", json=body,
                                        headers={"X-Request-Id": request_id}, timeout=timeout_s)
            return r.status_code == 200
        except httpx.HTTPError as e:
            logger.info("[%s] abort on %s did not get through: %s", request_id, url, _describe(e))
            return False

    async def _get_json(self, url: str, path: str, timeout_s: float) -> dict[str, Any] | None:
        try:
            r = await self.control.get(f"{url}{path}", timeout=timeout_s)
            body = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    # ---- requests -------------------------------------------------------------------------------

    @asynccontextmanager
    async def generate(self, url: str, body: dict[str, Any]) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """POST /generate; yields the NDJSON lines as dicts. Errors become WorkerError."""
        rid = body["request_id"]
        try:
            async with self.streams.stream("POST", f"{url}/generate", json=body,
                                           headers={"X-Request-Id": rid}) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise WorkerError(_error_message(resp), 400 if resp.status_code == 400 else 503)
                yield _ndjson(resp, url)
        except httpx.HTTPError as e:
            raise WorkerError(f"decode worker {url} failed: {_describe(e)}") from None

    async def prefill(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        rid = body["request_id"]
        try:
            r = await self.streams.post(f"{url}/prefill", json=body, headers={"X-Request-Id": rid})
        except httpx.HTTPError as e:
            raise WorkerError(f"prefill worker {url} failed: {_describe(e)}") from None
        if r.status_code != 200:
            raise WorkerError(_error_message(r), 400 if r.status_code == 400 else 503)
        try:
            return r.json()
        except ValueError:
            raise WorkerError(f"prefill worker {url} answered with invalid JSON") from None


async def _ndjson(resp: httpx.Response, url: str) -> AsyncIterator[dict[str, Any]]:
    async for line in resp.aiter_lines():
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
        except ValueError:
            raise WorkerError(f"worker {url} sent a line that is not JSON: {line[:80]!r}") from None
        if not isinstance(msg, dict):
            raise WorkerError(f"worker {url} sent a line that is not an object: {line[:80]!r}")
        yield msg


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return f"worker answered HTTP {resp.status_code}"
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        err = err.get("message")
    return str(err) if err else f"worker answered HTTP {resp.status_code}"


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
