"""The router's typed client of the worker contract (``pdserve.worker_api``), on two shared
httpx clients: every body sent is a contract model, every answer read is parsed into one.

``streams`` carries /generate and /prefill: no read deadline (a long prompt may queue), a
connect deadline, no connection cap. ``control`` carries /health, /load, /info and /abort with
short deadlines on a separate pool, so probes and aborts never queue behind busy streams.
Neither trusts proxy settings from the environment: workers are reached directly.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from pdserve.worker_api import (AbortRequest, CachedPrefix, CachedPrefixQuery, CacheReset, ErrorBody, ErrorCode,
                                GenerateRequest, Health, Info, Load, PeerDead, PeerDeadResult, PrefillRequest,
                                StreamLine, parse_line)

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


class WorkerError(Exception):
    """A worker could not serve one request (refused, unreachable, failed, or broke the protocol)."""

    def __init__(self, message: str, status: int = 503, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code    # the worker's own ErrorCode, when it answered with an ErrorBody


@dataclass
class Probe:
    """One /health answer: alive (answered), and whether it takes new requests."""

    answered: bool
    status: str            # "ok" | "draining" | "wedged" | ... | "unreachable" | "refused"
    step: int | None = None

    @property
    def ok(self) -> bool:
        return self.answered and self.status == "ok"


KEEPALIVE_EXPIRY_S = 2.0


class WorkerClient:
    def __init__(self, connect_timeout_s: float = 3.0, control_timeout_s: float = 2.0,
                 internal_token: str | None = None) -> None:
        # Workers that require the internal token (--internal-token) get it on every call.
        headers = {"Authorization": f"Bearer {internal_token}"} if internal_token else None
        # An idle connection is dropped well before the workers' uvicorn closes it (5 s): reusing
        # one as the server closes it fails the call with a ReadError (seen on /prefill).
        self.streams = httpx.AsyncClient(
            trust_env=False, headers=headers,
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )
        self.control = httpx.AsyncClient(
            trust_env=False, headers=headers,
            timeout=httpx.Timeout(control_timeout_s),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S),
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
            health: Health | None = Health.model_validate_json(r.content)
        except ValidationError:
            health = None  # it answered, so it is alive; what it said is unknown
        if health is not None:
            return Probe(True, health.status.value, health.step)
        return Probe(True, "ok" if r.status_code == 200 else f"http {r.status_code}")

    async def load(self, url: str, timeout_s: float) -> Load | None:
        return await self._get(url, "/load", Load, timeout_s)

    async def info(self, url: str, timeout_s: float) -> Info | None:
        return await self._get(url, "/info", Info, timeout_s)

    async def abort(self, url: str, request_id: str, timeout_s: float, origin: str | None = None) -> bool:
        """POST /abort; idempotent on the worker, best effort here (a dead worker is fine).
        `origin` says who asked (a worker may count it; older ones ignore it)."""
        body = AbortRequest(request_id=request_id, **({"origin": origin} if origin else {}))
        try:
            r = await self.control.post(f"{url}/abort", json=body.wire(),
                                        headers={"X-Request-Id": request_id}, timeout=timeout_s)
            return r.status_code == 200
        except httpx.HTTPError as e:
            logger.info("[%s] abort on %s did not get through: %s", request_id, url, _describe(e))
            return False

    async def peer_dead(self, url: str, body: PeerDead, timeout_s: float) -> int | None:
        """POST /peers/dead: how many rooms the worker at `url` failed for the dead peer (None:
        the call did not get through, or the worker predates the call)."""
        try:
            r = await self.control.post(f"{url}/peers/dead", json=body.wire(), timeout=timeout_s)
            return PeerDeadResult.model_validate_json(r.content).rooms if r.status_code == 200 else None
        except (httpx.HTTPError, ValidationError) as e:
            logger.info("telling %s that worker %s died did not get through: %s", url, body.worker_id, _describe(e))
            return None

    async def reset_prefix_cache(self, url: str, timeout_s: float) -> int:
        """POST /reset_prefix_cache: the cached blocks the worker forgot; WorkerError when the
        call did not get through or the worker refused it."""
        try:
            r = await self.control.post(f"{url}/reset_prefix_cache", timeout=timeout_s)
        except httpx.HTTPError as e:
            raise WorkerError(f"worker {url}: {_describe(e)}") from None
        if r.status_code != 200:
            raise _refused(r)
        return CacheReset.model_validate_json(r.content).forgotten_blocks

    async def cached_prefix(self, url: str, names: str, timeout_s: float) -> CachedPrefix | None:
        """POST /cached_prefix with a prompt's block names (hex); None when the worker did not
        answer in time, or answered anything but 200 (routing then goes by its own index)."""
        try:
            r = await self.control.post(f"{url}/cached_prefix", content=CachedPrefixQuery(names=names).wire_json(),
                                        headers={"Content-Type": "application/json"}, timeout=timeout_s)
            return CachedPrefix.model_validate_json(r.content) if r.status_code == 200 else None
        except (httpx.HTTPError, ValidationError):
            return None

    async def _get(self, url: str, path: str, model: type[M], timeout_s: float) -> M | None:
        try:
            r = await self.control.get(f"{url}{path}", timeout=timeout_s)
            return model.model_validate_json(r.content) if r.status_code == 200 else None
        except (httpx.HTTPError, ValidationError):
            return None

    # ---- requests -------------------------------------------------------------------------------

    @asynccontextmanager
    async def generate(self, url: str, body: GenerateRequest) -> AsyncIterator[AsyncIterator[StreamLine]]:
        """POST /generate; yields the stream's lines (``RoomLine``, ``TokenLine``). Errors
        become WorkerError."""
        try:
            async with self.streams.stream("POST", f"{url}/generate", content=body.wire_json(),
                                           headers=_json_headers(body.request_id)) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise _refused(resp)
                yield _lines(resp, url)
        except httpx.HTTPError as e:
            raise WorkerError(f"decode worker {url} failed: {_describe(e)}") from None

    async def prefill(self, url: str, body: PrefillRequest) -> None:
        """POST /prefill; returns once the KV is in the decode worker's blocks. A failed
        prefill (or a refused call) raises WorkerError with the worker's ErrorCode."""
        try:
            r = await self.streams.post(f"{url}/prefill", content=body.wire_json(),
                                        headers=_json_headers(body.request_id))
        except httpx.HTTPError as e:
            raise WorkerError(f"prefill worker {url} failed: {_describe(e)}") from None
        if r.status_code != 200:
            raise _refused(r)


def _json_headers(request_id: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "X-Request-Id": request_id}


async def _lines(resp: httpx.Response, url: str) -> AsyncIterator[StreamLine]:
    async for text in resp.aiter_lines():
        if not text.strip():
            continue
        try:
            yield parse_line(text)
        except ValueError:  # pydantic's ValidationError is one
            raise WorkerError(f"worker {url} sent a line that breaks the protocol: {text[:80]!r}") from None


def _refused(resp: httpx.Response) -> WorkerError:
    """A non-200 answer: its ErrorBody's message and code (an older or foreign answer: its status)."""
    status = 400 if resp.status_code == 400 else 503
    try:
        err = ErrorBody.model_validate_json(resp.content).error
    except ValidationError:
        return WorkerError(f"worker answered HTTP {resp.status_code}", status)
    return WorkerError(err.message, status, err.code)


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
