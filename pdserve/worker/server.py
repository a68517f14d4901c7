"""The worker's internal HTTP API (API.md): what the router calls. Rank 0 only."""
from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from pdserve.engine.sampling_params import SamplingParams
from pdserve.logs import REQUEST_ID, about
from pdserve.metrics import ABORT_ORIGINS, CONTENT_TYPE
from pdserve.scheduler.plan import StepOutput

from .worker import Worker

logger = logging.getLogger(__name__)


class GenerateBody(BaseModel):
    request_id: str = Field(min_length=1, max_length=256)
    prompt_ids: list[int] = Field(min_length=1)
    params: dict = Field(default_factory=dict)
    prefill_url: str | None = None
    prefill_worker_id: str | None = None


class DecodeTarget(BaseModel):
    worker_id: str
    decode_url: str
    blocks: list[int]


class PrefillBody(BaseModel):
    request_id: str = Field(min_length=1, max_length=256)
    prompt_ids: list[int] = Field(min_length=1)
    params: dict = Field(default_factory=dict)
    decode: DecodeTarget


class AbortBody(BaseModel):
    request_id: str = Field(min_length=1, max_length=256)
    origin: str = "router"  # who asked (pdserve.metrics.ABORT_ORIGINS); older routers send none


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


def sampling_params(d: dict) -> SamplingParams:
    d = dict(d)
    if "logit_bias" in d and d["logit_bias"]:
        d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"].items()}
    d.pop("stop", None)  # stop strings are the router's
    params = SamplingParams(**d)
    params.validate()
    return params


def output_line(out: StepOutput) -> dict:
    lp = out.logprobs
    return {"token_ids": [] if out.token_id is None else [out.token_id],
            "logprobs": None if lp is None else [{"token_id": lp.token_id, "logprob": lp.logprob,
                                                  "top": [list(t) for t in lp.top]}],
            "finish_reason": out.finish_reason, "error": out.error}


def build_app(worker: Worker, model_name: str) -> FastAPI:
    app = FastAPI(title=f"pdserve {worker.settings.role} worker")
    app.add_middleware(RequestIdContext)
    engine = worker.engine
    role = worker.settings.role
    http = httpx.AsyncClient(timeout=httpx.Timeout(10.0))
    bootstraps: dict[str, list[str]] = {}  # decode worker id → its per-rank bootstrap info

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    def draining() -> JSONResponse:
        return JSONResponse({"error": "the worker is draining"}, status_code=503, headers={"Retry-After": "5"})

    async def parse(request: Request, model: type[BaseModel]):
        try:
            return model.model_validate(json.loads(await request.body())), None
        except (ValueError, ValidationError) as e:
            return None, error(400, f"bad request body: {e}")

    @app.get("/health")
    async def health():
        body = {"status": "ok", "role": role, "step": worker.step_count,
                "seconds_since_step": round(worker.seconds_since_step(), 3)}
        if worker.draining:
            body["status"] = "draining"
        elif not worker.healthy():
            body["status"] = "wedged" if worker.error is None else "failed"
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/ready")
    async def ready():
        ok = worker.error is None and not worker.draining
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/info")
    async def info():
        sched = engine.scheduler
        return {"role": role, "worker_id": worker.settings.worker_id, "model": model_name,
                "max_model_len": sched.config.max_model_len, "block_size": sched.config.block_size,
                "num_blocks": sched.allocator.num_blocks, "tp": worker.settings.tp,
                "eos_token_ids": sorted(sched.eos_token_ids)}

    @app.get("/load")
    async def load():
        return worker.load()

    @app.get("/bootstrap")
    async def bootstrap():
        if worker.bootstrap is None or role != "decode":
            return error(404, "only decode workers publish a transfer bootstrap")
        return {"worker_id": worker.settings.worker_id, "ranks": worker.bootstrap}

    @app.get("/metrics")
    async def metrics():
        return Response(worker.metrics.render(), media_type=CONTENT_TYPE)

    if os.environ.get("PDSERVE_TEST_HOOKS") == "1":
        @app.post("/debug/wedge")
        async def wedge(request: Request):
            worker.wedge(float(json.loads(await request.body()).get("seconds", 30)))
            return {"ok": True}

    @app.post("/abort")
    async def abort(request: Request):
        body, err = await parse(request, AbortBody)
        if err:
            return error(400, 'body must be {"request_id": str, "origin": str (optional)}')
        if body.origin not in ABORT_ORIGINS:
            return error(400, f"unknown abort origin {body.origin!r}; one of {', '.join(ABORT_ORIGINS)}")
        # idempotent: an unknown or finished request is fine and counts nothing (aborts.py)
        return {"ok": True, "aborted": worker.abort(body.request_id, origin=body.origin)}

    @app.post("/generate")
    async def generate(request: Request):
        if role == "prefill":
            return error(404, "a prefill worker serves /prefill, not /generate")
        if worker.draining:
            return draining()
        body, err = await parse(request, GenerateBody)
        if err:
            return err
        if role == "decode" and not body.prefill_worker_id:
            return error(400, "a decode worker needs prefill_worker_id")
        try:
            params = sampling_params(body.params)
            peer = {"worker_id": body.prefill_worker_id} if role == "decode" else None
            q = worker.submit(body.request_id, body.prompt_ids, params, peer)
        except (TypeError, ValueError) as e:
            return error(400, str(e))
        return StreamingResponse(_stream(worker, body.request_id, q), media_type="application/x-ndjson")

    async def _stream(w: Worker, rid: str, q: asyncio.Queue) -> AsyncIterator[bytes]:
        finished = False
        try:
            while True:
                out: StepOutput = await q.get()
                if out.room_blocks is not None:
                    room = {"request_id": rid, "blocks": out.room_blocks, "worker_id": w.settings.worker_id}
                    yield (json.dumps({"room": room}) + "\n").encode()
                    continue
                yield (json.dumps(output_line(out)) + "\n").encode()
                if out.finish_reason:
                    finished = True
                    return
        finally:
            w.release(rid)
            if not finished:  # the client went away: free its blocks now
                w.reader_left(rid)

    @app.post("/prefill")
    async def prefill(request: Request):
        if role != "prefill":
            return error(404, "only prefill workers serve /prefill")
        if worker.draining:
            return draining()
        body, err = await parse(request, PrefillBody)
        if err:
            return err
        rid = body.request_id
        try:
            params = sampling_params(body.params)
            ranks = bootstraps.get(body.decode.worker_id)
            if ranks is None:
                r = await http.get(f"{body.decode.decode_url.rstrip('/')}/bootstrap")
                r.raise_for_status()
                ranks = bootstraps[body.decode.worker_id] = r.json()["ranks"]
            if len(ranks) != worker.settings.tp:  # rank i writes to rank i: equal TP sizes only
                why = (f"the decode worker has TP={len(ranks)} and this prefill worker TP={worker.settings.tp}; "
                       "pdserve needs equal TP sizes")
                logger.warning("request %s: %s", rid, why, extra=about(rid))
                return JSONResponse({"status": "failed", "error": why})
            q = worker.submit(rid, body.prompt_ids, params, {"bootstrap": ranks, "blocks": body.decode.blocks})
        except (TypeError, ValueError, KeyError) as e:
            return error(400, str(e))
        except httpx.HTTPError as e:
            logger.warning("request %s: decode worker %s unreachable: %s", rid, body.decode.decode_url, e,
                           extra=about(rid))
            return JSONResponse({"status": "failed", "error": f"decode worker unreachable: {e}"})
        done = False
        try:
            while True:
                out: StepOutput = await q.get()
                if out.finish_reason == "prefilled" and out.token_id is None:
                    done = True
                    return {"status": "done"}
                if out.finish_reason in ("error", "abort"):
                    done = True
                    if out.finish_reason == "error":  # the decode worker may have restarted
                        bootstraps.pop(body.decode.worker_id, None)
                    return {"status": "failed", "error": out.error or "aborted"}
        finally:
            worker.release(rid)
            if not done:
                worker.reader_left(rid)

    @app.on_event("shutdown")
    async def _close() -> None:
        await http.aclose()

    return app
