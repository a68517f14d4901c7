"""The router's HTTP edge: the FastAPI app, its routes (the OpenAI API with its Responses API,
Anthropic's Messages API, /health, /ready, /metrics, and vLLM's /tokenize, /detokenize,
/version and /reset_prefix_cache), the middleware every request passes, and the mapping of every
error to an OpenAI error object (Anthropic's on /v1/messages; a 405 keeps its Allow header).

Middleware (``RequestContextMiddleware``), before a handler runs:

* the request id: X-Request-Id accepted (or made), stored in ``scope["state"]`` with the
  arrival time, sent back, and set as the logging context (``pdserve.logs.REQUEST_ID``) so
  every log line about the request carries it. Workers keep a tombstone for every room that
  ended and refuse a room id they have seen, so a client that reuses its X-Request-Id (a retry)
  must not reuse the room id: the second use of an id within the remembered window gets a
  suffix (``RequestIds``);
* the API key: ``Authorization: Bearer <key>`` (or ``x-api-key``) on /v1/* and
  /reset_prefix_cache when the router has one (401 otherwise);
* the body limit: 413 for a Content-Length over the limit, or once more bytes than that arrive;
* the drain: once the router drains, /v1/* gets 503 with Retry-After; calls under way are
  counted (``Calls.active``) so the drain knows when none is left;
* the access log: one line per request, except the probes' and scrapers' paths.

Handlers read the body themselves (content type, JSON, then the pydantic model), so every way a
body can be wrong ends as a 400 OpenAI error object, as does FastAPI's own 422.

/health is liveness (the router's own loop; 200 while workers are down), /ready is readiness
(workers to route to, not draining); /v1/models answers only when ready, so a client that lists
models first learns that requests would fail. Both probes list the workers and their state.
"""
from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.frontend.config import RouterConfig
from pdserve.frontend.errors import (RETRY_AFTER_S, APIError, bad_api_key, body_for, from_status, internal,
                                     invalid, too_large, unavailable, validation_message)
from pdserve.frontend.protocol import (ChatCompletionRequest, CompletionRequest, CountTokensRequest, DetokenizeRequest,
                                       MessagesRequest, ResponsesRequest, TokenizeRequest)
from pdserve.frontend.render import version
from pdserve.frontend.requests import (Call, Calls, Serving, create_chat_completion, create_completion, create_message,
                                       create_response, input_items_page, stored_response)
from pdserve.frontend.server import Router
from pdserve.frontend.tokens import count_tokens, detokenize, tokenize
from pdserve.logs import REQUEST_ID
from pdserve.metrics import CONTENT_TYPE
from pdserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
access_log = logging.getLogger("pdserve.access")
M = TypeVar("M", bound=BaseModel)
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapers: no access log
KEYED_PATHS = frozenset({"/reset_prefix_cache"})  # beside /v1/*: what changes the server needs the key
_VALID_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


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
    ids = RequestIds()
    serving = router.serving
    app.add_middleware(RequestContextMiddleware, calls=router.calls, api_key=config.api_key,
                       max_body=config.max_request_bytes)
    _add_error_handlers(app)
    started = int(time.time())

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        _check_ready(router)
        return {"object": "list", "data": [_model_card(serving, started)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        serving.check_model(model)
        _check_ready(router)
        return _model_card(serving, started)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        return await create_completion(serving, req, _call(ids, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        return await create_chat_completion(serving, req, _call(ids, request))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        req = await _parse(request, ResponsesRequest)
        return await create_response(serving, req, _call(ids, request))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return stored_response(serving, response_id).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def get_input_items(response_id: str, limit: int = Query(20, ge=1, le=100),
                              order: Literal["asc", "desc"] = "desc", after: str | None = None) -> dict[str, Any]:
        return input_items_page(serving, response_id, limit, order, after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        stored_response(serving, response_id)
        serving.responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        req = await _parse(request, MessagesRequest)
        return await create_message(serving, req, _call(ids, request))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> dict[str, Any]:
        return await count_tokens(serving, await _parse(request, CountTokensRequest))

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        return await tokenize(serving, await _parse(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        return detokenize(serving, await _parse(request, DetokenizeRequest))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache_route() -> dict[str, Any]:
        return await router.reset_prefix_caches()

    @app.get("/version")
    async def version_route() -> dict[str, str]:
        return {"version": version()}

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


def _model_card(serving: Serving, created: int) -> dict[str, Any]:
    return {"id": serving.config.served_model_name, "object": "model", "created": created,
            "owned_by": "pdserve", "max_model_len": serving.max_model_len}


def _call(ids: RequestIds, request: Request) -> Call:
    rid = request.state.request_id
    return Call(request.url.path, rid, ids.room_base(rid), request, request.state.arrival)


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
    def reply(request: Request, error: APIError, extra: dict[str, str] | None = None) -> JSONResponse:
        if error.status >= 500:
            logger.error("[%s] %s", getattr(request.state, "request_id", "-"), error.message)
        retry = error.retry_after_s or RETRY_AFTER_S
        headers = {"Retry-After": str(retry)} if error.status in (429, 503) else {}
        return JSONResponse(body_for(request.url.path, error), status_code=error.status,
                            headers={**(extra or {}), **headers})

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return reply(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return reply(request, invalid(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return reply(request, from_status(exc.status_code, str(exc.detail)), exc.headers)  # 405: Allow

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("[%s] unexpected error", getattr(request.state, "request_id", "-"))
        return reply(request, internal(f"Internal error: {type(exc).__name__}"))


# ---- middleware ---------------------------------------------------------------------------------


class RequestContextMiddleware:
    """What every request gets before a handler runs (see the module's docstring)."""

    def __init__(self, app: ASGIApp, calls: Calls, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.calls = calls
        self.api_key = api_key
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        state = scope.setdefault("state", {})
        path = scope["path"]
        status_seen: list[int] = []

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", state.get("request_id", "").encode("latin-1"))]
            await send(message)

        state["arrival"] = time.monotonic()
        state["request_id"] = client_id(None)
        api = path.startswith("/v1/") or path in KEYED_PATHS
        token = REQUEST_ID.set(state["request_id"])
        counted = False
        try:
            state["request_id"] = client_id(headers.get("x-request-id"))
            REQUEST_ID.set(state["request_id"])
            if api and self.calls.draining:
                raise unavailable("The server is shutting down; retry the request.")
            if api and self.api_key is not None and not self._authorized(headers):
                raise bad_api_key()
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                raise too_large(self.max_body)
        except APIError as e:
            await send_error(send_with_id, e, path)
        else:
            if api:
                self.calls.active += 1
                counted = True
            await self.app(scope, self._limited(receive), send_with_id)
        finally:
            if counted:
                self.calls.active -= 1
            if path not in QUIET_PATHS:
                _log_access(scope, status_seen[0] if status_seen else 0, state["arrival"])
            REQUEST_ID.reset(token)

    def _authorized(self, headers: dict[str, str]) -> bool:
        """`Authorization: Bearer <key>`, or `x-api-key: <key>` as Anthropic's clients send it."""
        key = (self.api_key or "").encode()
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
            return True
        return "x-api-key" in headers and hmac.compare_digest(headers["x-api-key"].strip().encode(), key)

    def _limited(self, receive: Receive) -> Receive:
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise too_large(self.max_body)
            return message

        return wrapped


def _log_access(scope: Scope, status: int, arrival: float) -> None:
    ms = (time.monotonic() - arrival) * 1000
    client = scope.get("client")
    http = {"method": scope["method"], "path": scope["path"], "status": status,
            "duration_ms": round(ms, 1), "client": f"{client[0]}:{client[1]}" if client else None}
    access_log.info("%s %s %s %.1f ms", scope["method"], scope["path"], status or "-", ms,
                    extra={"http": http})


async def send_error(send: Send, error: APIError, path: str) -> None:
    """`error` as a complete JSON response; a 503 says when to retry, a 401 which scheme."""
    body = json.dumps(body_for(path, error)).encode()
    headers: list[Any] = [(b"content-type", b"application/json"),
                          (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if error.status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def client_id(header: str | None) -> str:
    """The X-Request-Id to answer with: the client's if well-formed, else a new one."""
    if header is None or header == "":
        return uuid.uuid4().hex
    if not _VALID_ID.fullmatch(header):
        raise invalid("X-Request-Id must be 1-128 printable ASCII characters without spaces",
                      "X-Request-Id")
    return header


class RequestIds:
    """Room ids from client request ids, never handed out twice in the remembered window."""

    def __init__(self, remember: int = 65536) -> None:
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._remember = remember

    def room_base(self, request_id: str) -> str:
        """A worker-side id derived from `request_id`, never handed out twice in the window."""
        uses = self._seen.pop(request_id, 0)
        self._seen[request_id] = uses + 1
        while len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        return request_id if uses == 0 else f"{request_id}~{uses}"
