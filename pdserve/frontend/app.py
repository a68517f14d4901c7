"""The router's FastAPI app: the OpenAI routes, /health, /ready, /metrics, and error mapping.

Handlers read the body themselves (content type, JSON, then the pydantic model), so every way a
body can be wrong ends as a 400 OpenAI error object, as does FastAPI's own 422.

/health is liveness (the router's own loop; 200 while workers are down), /ready is readiness
(workers to route to, not draining); /v1/models answers only when ready, so a client that lists
models first learns that requests would fail. Both probes list the workers and their state.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.frontend.chat import create_chat_completion
from pdserve.frontend.completions import create_completion
from pdserve.frontend.config import RouterConfig
from pdserve.frontend.errors import APIError, from_status, internal, invalid, unavailable, validation_message
from pdserve.frontend.middleware import RETRY_AFTER_S, RequestContextMiddleware
from pdserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.frontend.server import Router
from pdserve.frontend.serving import Call
from pdserve.metrics import CONTENT_TYPE
from pdserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def create_app(config: RouterConfig, tokenizer: Tokenizer | None = None) -> FastAPI:
    router = Router(config, tokenizer)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="pdserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    app.add_middleware(RequestContextMiddleware, router=router)
    _add_error_handlers(app)
    started = int(time.time())

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        _check_ready(router)
        return {"object": "list", "data": [_model_card(router, started)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        router.check_model(model)
        _check_ready(router)
        return _model_card(router, started)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        return await create_completion(router, req, _call(router, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        return await create_chat_completion(router, req, _call(router, request))

    @app.get("/health")
    async def health() -> Response:
        alive, status = router.liveness()
        return JSONResponse({"status": status, "ready": router.ready, "workers": _workers(router)},
                            status_code=200 if alive else 503)

    @app.get("/ready")
    async def ready() -> Response:
        ok = router.ready
        status = "ok" if ok else "draining" if router.draining else "no workers"
        return JSONResponse({"ready": ok, "status": status, "workers": _workers(router)},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    return app


def _workers(router: Router) -> list[dict[str, Any]]:
    return [{"url": w.url, "role": w.role.value, "healthy": w.healthy, "draining": w.draining,
             "available": w.available, "status": w.status, "inflight": len(w.inflight)}
            for w in router.pool.workers]


def _check_ready(router: Router) -> None:
    if not router.ready:
        raise unavailable("The model is not being served right now: no worker is ready.")


def _model_card(router: Router, created: int) -> dict[str, Any]:
    return {"id": router.config.served_model_name, "object": "model", "created": created,
            "owned_by": "pdserve", "max_model_len": router.max_model_len}


def _call(router: Router, request: Request) -> Call:
    rid = request.state.request_id
    return Call(request.url.path, rid, router.ids.room_base(rid), request, request.state.arrival)


async def _parse(request: Request, model: type[M]) -> M:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise invalid(f"Content-Type must be application/json, got {ctype or 'none'!r}", None,
                      "invalid_content_type")
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError):
        raise invalid("The request body is not valid JSON.", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise invalid("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e.errors(include_url=False))
        raise invalid(message, param) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _add_error_handlers(app: FastAPI) -> None:
    def reply(request: Request, error: APIError) -> JSONResponse:
        if error.status >= 500:
            logger.error("[%s] %s", getattr(request.state, "request_id", "-"), error.message)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return reply(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return reply(request, invalid(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return reply(request, from_status(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("[%s] unexpected error", getattr(request.state, "request_id", "-"))
        return reply(request, internal(f"Internal error: {type(exc).__name__}"))
