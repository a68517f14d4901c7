"""The worker's internal HTTP API: what the router calls. Rank 0 only.

Every body and answer is a model of ``pdserve.worker_api`` (the contract; API.md describes it).
A call that fails answers an error status with ``ErrorBody`` — a failed prefill included."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from pdserve.block_names import NAME_BYTES
from pdserve.engine.sequence import FinishReason as Ended, TokenLogprobs
from pdserve.logs import REQUEST_ID, about
from pdserve.metrics import ABORT_ORIGINS, CONTENT_TYPE
from pdserve.scheduler.plan import KVPeer, StepOutput
from pdserve.worker_api import (LOGPROB_FLOOR, NDJSON, RETRY_AFTER_S, AbortRequest, AbortResult, Bootstrap,
                                CachedPrefix, CachedPrefixQuery, CacheReset, ErrorBody, ErrorCode, FinishReason,
                                GenerateRequest, Health, HealthStatus, Info, Load, PeerDead, PeerDeadResult,
                                PrefillDone, PrefillRequest, Role, Room, RoomLine, SamplingParams, TokenLine,
                                TokenLogprob, line)

from .lease import RouterLease
from .peers import PeerRooms
from .worker import Worker

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


class RequestIdContext:
    """Every log record made while serving a call that carries X-Request-Id (the router sends
    the request's room id) carries that id, as the router's own records do."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        rid = None
        if scope["type"] == "http":
            rid = next((v.decode("latin-1")[:256] for k, v in scope["headers"] if k == b"x-request-id"), None)
        if not rid:
            return await self.app(scope, receive, send)
        token = REQUEST_ID.set(rid)
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_ID.reset(token)


OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # liveness, readiness, scrapes: no token


class InternalToken:
    """With a token configured (--internal-token, $PDSERVE_INTERNAL_TOKEN), every path but
    `OPEN_PATHS` needs ``Authorization: Bearer <token>``; a call without it gets 401 and an
    ``ErrorBody``, so a pod in the cluster cannot abort or inject requests. /metrics stays open
    for the scraper: it reports counts, and changes nothing."""

    def __init__(self, app, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(got, self.expected):
            return await self.app(scope, receive, send)
        body = json.dumps(ErrorBody.of(ErrorCode.UNAUTHORIZED, "this worker's internal API needs its token "
                                       "(Authorization: Bearer, --internal-token)").wire()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def output_line(out: StepOutput) -> TokenLine:
    lp = out.logprobs
    return TokenLine(token_ids=[] if out.token_id is None else [out.token_id],
                     logprobs=None if lp is None else [token_logprob(lp)],
                     finish_reason=None if out.finish_reason is None else FinishReason(out.finish_reason),
                     error=out.error, peer_dead=out.peer_dead, worker_died=out.worker_died,
                     cached_tokens=out.cached_tokens if out.finish_reason else None,
                     prompt_logprobs=None if out.prompt_logprobs is None else [
                         None if e is None else token_logprob(e) for e in out.prompt_logprobs])


def token_logprob(lp: TokenLogprobs) -> TokenLogprob:
    """A position's logprobs as sent. A token that a grammar rules out has logprob -inf, which
    JSON cannot carry: it is sent as LOGPROB_FLOOR, as vLLM reports it."""
    return TokenLogprob(token_id=lp.token_id, logprob=max(lp.logprob, LOGPROB_FLOOR),
                        top=[(t, max(v, LOGPROB_FLOOR)) for t, v in lp.top])


def build_app(worker: Worker, model_name: str, internal_token: str | None = None,
              router_lease_s: float = 0.0) -> FastAPI:
    lease = RouterLease(router_lease_s)  # renewed by every router call (lease.py)
    watcher: list[asyncio.Task[None]] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        lease.renew()
        if lease.enabled:
            watcher.append(asyncio.create_task(watch_lease(), name="router-lease"))
        try:
            yield
        finally:
            for task in watcher:
                task.cancel()
            await http.aclose()

    app = FastAPI(title=f"pdserve {worker.settings.role} worker", lifespan=lifespan)
    app.add_middleware(RequestIdContext)
    if internal_token:
        app.add_middleware(InternalToken, token=internal_token)
    engine = worker.engine
    role = Role(worker.settings.role)
    # worker to worker (prefill → decode /bootstrap): the same token
    http = httpx.AsyncClient(timeout=httpx.Timeout(10.0), trust_env=False,
                             headers={"Authorization": f"Bearer {internal_token}"} if internal_token else None)
    bootstraps: dict[str, list[str]] = {}  # decode worker id → its per-rank bootstrap info
    # this process, as its peers and the router tell it from a restarted one with the same id
    incarnation = secrets.token_hex(8)
    peer_rooms = PeerRooms()  # the other worker of each PD room here (/peers/dead)

    def error(code: ErrorCode, message: str) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if code is ErrorCode.DRAINING else None
        return JSONResponse(ErrorBody.of(code, message).wire(), status_code=code.status, headers=headers)

    def draining() -> JSONResponse:
        return error(ErrorCode.DRAINING, "the worker is draining")

    async def parse(request: Request, model: type[M]) -> M | JSONResponse:
        """The body as `model`, its sampling params checked; else the 400 answer."""
        try:
            body = model.model_validate_json(await request.body())
            params: SamplingParams | None = getattr(body, "params", None)
            if params is not None:
                params.validate()
                params.stop = []  # stop strings are the router's
                if params.structured is not None:  # compiled here, in a thread: the loop only looks it up
                    why = await asyncio.to_thread(engine.grammars.check, params.structured)
                    if why is not None:
                        return error(ErrorCode.BAD_REQUEST, f"params.structured: {why}")
            return body
        except (ValueError, ValidationError) as e:
            return error(ErrorCode.BAD_REQUEST, f"bad request body: {e}")
        except ClientDisconnect:  # the router aborted the call (a sibling choice ended): not an error
            logger.info("%s: the caller went away before its body arrived", request.url.path)
            return error(ErrorCode.ABORTED, "the caller went away")

    @app.get("/health")
    async def health() -> JSONResponse:
        status = HealthStatus.OK
        if worker.draining:
            status = HealthStatus.DRAINING
        elif not worker.healthy():
            status = HealthStatus.WEDGED if worker.error is None else HealthStatus.FAILED
        body = Health(status=status, role=role, step=worker.step_count,
                      seconds_since_step=round(worker.seconds_since_step(), 3))
        return JSONResponse(body.wire(), status_code=200 if status is HealthStatus.OK else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = worker.error is None and not worker.draining
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/info")
    async def info() -> dict:
        sched = engine.scheduler
        return Info(role=role, worker_id=worker.settings.worker_id, model=model_name,
                    max_model_len=sched.config.max_model_len, block_size=sched.config.block_size,
                    num_blocks=sched.allocator.num_blocks, tp=worker.settings.tp,
                    eos_token_ids=sorted(sched.eos_token_ids), max_num_seqs=sched.config.max_num_seqs,
                    incarnation=incarnation,
                    prefix_salt=engine.prefix_salt.hex() if engine.prefix_salt is not None else "").wire()

    @app.get("/load")
    async def load() -> dict:
        lease.renew()
        return Load.model_validate(worker.load()).wire()

    @app.get("/bootstrap")
    async def bootstrap() -> Response:
        if worker.bootstrap is None or role is not Role.DECODE:
            return error(ErrorCode.NOT_SERVED, "only decode workers publish a transfer bootstrap")
        return JSONResponse(Bootstrap(worker_id=worker.settings.worker_id, ranks=worker.bootstrap).wire())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(worker.metrics.render(), media_type=CONTENT_TYPE)

    if worker.faults is not None and worker.faults.debug_routes:  # only a test's fault plan (faults.py)
        @app.post("/debug/wedge")
        async def wedge(request: Request) -> dict:
            worker.wedge(float(json.loads(await request.body()).get("seconds", 30)))
            return {"ok": True}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """Forget the prefix cache on every rank in the next step; answers once it is applied."""
        lease.renew()
        if worker.draining:
            return draining()
        done = asyncio.wrap_future(worker.reset_prefix_cache())
        while worker.error is None:  # a loop that failed applies nothing more
            try:
                forgotten = await asyncio.wait_for(asyncio.shield(done), 1.0)
            except asyncio.TimeoutError:
                continue
            logger.info("prefix cache reset: %d cached block(s) forgotten", forgotten)
            return JSONResponse(CacheReset(forgotten_blocks=forgotten).wire())
        return error(ErrorCode.DRAINING, f"the worker stopped: {worker.error}")

    @app.post("/cached_prefix")
    async def cached_prefix(request: Request) -> Response:
        """How much of a prompt (its block names) this worker's prefix cache holds: routing asks."""
        lease.renew()
        body = await parse(request, CachedPrefixQuery)
        if isinstance(body, JSONResponse):
            return body
        try:
            raw = bytes.fromhex(body.names)
        except ValueError:
            return error(ErrorCode.BAD_REQUEST, "names must be one hex string")
        most = engine.scheduler.config.max_model_len // engine.scheduler.config.block_size
        if len(raw) % NAME_BYTES or len(raw) // NAME_BYTES > most:
            return error(ErrorCode.BAD_REQUEST, f"names must be at most {most} names of {NAME_BYTES} bytes")
        names = [raw[i:i + NAME_BYTES] for i in range(0, len(raw), NAME_BYTES)]
        device, host = engine.cached_prefix(names)
        load = Load.model_validate(worker.load())
        return JSONResponse(CachedPrefix(device_blocks=device, host_blocks=host, load=load).wire())

    @app.post("/abort")
    async def abort(request: Request) -> Response:
        lease.renew()
        body = await parse(request, AbortRequest)
        if isinstance(body, JSONResponse):
            return error(ErrorCode.BAD_REQUEST, 'body must be {"request_id": str, "origin": str (optional)}')
        if body.origin not in ABORT_ORIGINS:
            return error(ErrorCode.BAD_REQUEST,
                         f"unknown abort origin {body.origin!r}; one of {', '.join(ABORT_ORIGINS)}")
        # idempotent: an unknown or finished request is fine and counts nothing (aborts.py)
        return JSONResponse(AbortResult(aborted=worker.abort(body.request_id, origin=body.origin)).wire())

    @app.post("/peers/dead")
    async def peers_dead(request: Request) -> Response:
        """A peer worker died (all its ranks): fail and fence the rooms shared with it, now."""
        lease.renew()
        body = await parse(request, PeerDead)
        if isinstance(body, JSONResponse):
            return body
        rooms = peer_rooms.take(body.worker_id, body.incarnation)
        bootstraps.pop(body.worker_id, None)  # a restarted decode worker publishes a new one
        if rooms:
            logger.warning("peer worker %s (incarnation %s) is dead (%s): its %d room(s) here fail where still "
                           "open and are fenced", body.worker_id, body.incarnation or "any", body.reason, len(rooms))
            worker.peer_dead(rooms, f"{body.reason} (worker {body.worker_id})")
        return JSONResponse(PeerDeadResult(rooms=len(rooms)).wire())

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        if role is Role.PREFILL:
            return error(ErrorCode.NOT_SERVED, "a prefill worker serves /prefill, not /generate")
        lease.renew()
        if worker.draining:
            return draining()
        body = await parse(request, GenerateRequest)
        if isinstance(body, JSONResponse):
            return body
        try:
            peer = KVPeer(body.prefill_worker_id) if role is Role.DECODE and body.prefill_worker_id else None
            q = worker.submit(body.request_id, body.prompt_ids, body.params, peer)
        except (TypeError, ValueError) as e:
            return error(ErrorCode.BAD_REQUEST, str(e))
        if peer is not None:
            peer_rooms.add(body.request_id, peer.worker_id, body.prefill_incarnation)
        return StreamingResponse(_stream(worker, body.request_id, q), media_type=NDJSON)

    async def _stream(w: Worker, rid: str, q: asyncio.Queue) -> AsyncIterator[bytes]:
        finished = False
        try:
            while True:
                out: StepOutput = await q.get()
                if out.room_blocks is not None:
                    yield line(RoomLine(room=Room(request_id=rid, blocks=out.room_blocks,
                                                  worker_id=w.settings.worker_id,
                                                  cached_blocks=out.room_cached)))
                    continue
                yield line(output_line(out))
                if out.finish_reason:
                    finished = True
                    return
        finally:
            w.release(rid)
            peer_rooms.ended(rid)
            if not finished:  # the client went away: free its blocks now
                w.reader_left(rid)

    @app.post("/prefill")
    async def prefill(request: Request) -> Response:
        if role is not Role.PREFILL:
            return error(ErrorCode.NOT_SERVED, "only prefill workers serve /prefill")
        lease.renew()
        if worker.draining:
            return draining()
        body = await parse(request, PrefillRequest)
        if isinstance(body, JSONResponse):
            return body
        rid = body.request_id
        try:
            ranks = bootstraps.get(body.decode.worker_id)
            if ranks is None:
                r = await http.get(f"{body.decode.decode_url.rstrip('/')}/bootstrap")
                r.raise_for_status()
                ranks = bootstraps[body.decode.worker_id] = Bootstrap.model_validate_json(r.content).ranks
            if len(ranks) != worker.settings.tp:  # rank i writes to rank i: equal TP sizes only
                why = (f"the decode worker has TP={len(ranks)} and this prefill worker TP={worker.settings.tp}; "
                       "pdserve needs equal TP sizes")
                logger.warning("request %s: %s", rid, why, extra=about(rid))
                return error(ErrorCode.PREFILL_FAILED, why)
            peer = KVPeer(body.decode.worker_id, tuple(ranks), tuple(body.decode.blocks),
                          body.decode.cached_blocks)
            q = worker.submit(rid, body.prompt_ids, body.params, peer)
            peer_rooms.add(rid, body.decode.worker_id, body.decode.incarnation)
        except (TypeError, ValueError, KeyError) as e:
            return error(ErrorCode.BAD_REQUEST, str(e))
        except httpx.HTTPError as e:
            logger.warning("request %s: decode worker %s unreachable: %s", rid, body.decode.decode_url, e,
                           extra=about(rid))
            return error(ErrorCode.DECODE_UNREACHABLE, f"decode worker unreachable: {e}")
        done = False
        try:
            while True:
                out: StepOutput = await q.get()
                if out.finish_reason is Ended.PREFILLED:  # the KV and first token are in decode's blocks
                    done = True
                    return JSONResponse(PrefillDone(cached_tokens=out.cached_tokens or 0).wire())
                if out.finish_reason in (Ended.ERROR, Ended.ABORT):
                    done = True
                    if out.finish_reason is Ended.ERROR:  # the decode worker may have restarted
                        bootstraps.pop(body.decode.worker_id, None)
                        if out.peer_dead:  # not this prefill's fault: the decode worker is gone
                            return error(ErrorCode.DECODE_UNREACHABLE, out.error or "the decode worker died")
                        if out.worker_died:  # nor the request's: this worker stops (503, Retry-After)
                            return error(ErrorCode.DRAINING, out.error or "a rank of this worker died")
                        return error(ErrorCode.PREFILL_FAILED, out.error or "the prefill failed")
                    return error(ErrorCode.ABORTED, out.error or "aborted")
        finally:
            worker.release(rid)
            peer_rooms.ended(rid)
            if not done:
                worker.reader_left(rid)

    async def watch_lease() -> None:
        """Abort what is in flight once no router called for the lease (lease.py)."""
        while True:
            await asyncio.sleep(min(1.0, lease.lease_s / 4))
            if not lease.expired() or not worker.in_flight():
                continue
            ids = worker.in_flight_ids()
            logger.warning("no router call for %.1f s (--router-lease %g): aborting %d request(s) in flight",
                           lease.silence(), lease.lease_s, len(ids))
            for rid in ids:
                worker.abort(rid, "abort", origin="timeout")
            lease.renew()  # the next round of aborts, if any, after another lease

    return app
