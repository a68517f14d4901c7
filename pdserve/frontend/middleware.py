"""One ASGI middleware for what every request gets before a handler runs.

* the request id: X-Request-Id accepted (or made), stored in ``scope["state"]`` with the
  arrival time, sent back, and set as the logging context (``pdserve.logs.REQUEST_ID``) so
  every log line about the request carries it;
* the API key: ``Authorization: Bearer <key>`` on /v1/* when the router has one (401 otherwise);
* the body limit: 413 for a Content-Length over the limit, or once more bytes than that arrive;
* the drain: once the router drains, /v1/* gets 503 with Retry-After; calls under way are
  counted (``Router.active``) so the drain knows when none is left;
* the access log: one line per request, except the probes' and scrapers' paths.
"""
from __future__ import annotations

import hmac
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.frontend.errors import APIError, bad_api_key, too_large, unavailable
from pdserve.frontend.ids import RequestIds
from pdserve.logs import REQUEST_ID

if TYPE_CHECKING:
    from pdserve.frontend.server import Router

access_log = logging.getLogger("pdserve.access")
RETRY_AFTER_S = 5
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapers: no access log


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, router: Router) -> None:
        self.app = app
        self.router = router
        self.api_key = router.config.api_key
        self.max_body = router.config.max_request_bytes

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
        state["request_id"] = RequestIds.client_id(None)
        api = path.startswith("/v1/")
        token = REQUEST_ID.set(state["request_id"])
        counted = False
        try:
            state["request_id"] = RequestIds.client_id(headers.get("x-request-id"))
            REQUEST_ID.set(state["request_id"])
            if api and self.router.draining:
                raise unavailable("The server is shutting down; retry the request.")
            if api and self.api_key is not None and not self._authorized(headers):
                raise bad_api_key()
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                raise too_large(self.max_body)
        except APIError as e:
            await send_error(send_with_id, e)
        else:
            if api:
                self.router.active += 1
                counted = True
            await self.app(scope, self._limited(receive), send_with_id)
        finally:
            if counted:
                self.router.active -= 1
            if path not in QUIET_PATHS:
                _log_access(scope, status_seen[0] if status_seen else 0, state["arrival"])
            REQUEST_ID.reset(token)

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                  (self.api_key or "").encode())

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


async def send_error(send: Send, error: APIError) -> None:
    """`error` as a complete JSON response; a 503 says when to retry, a 401 which scheme."""
    body = json.dumps(error.body()).encode()
    headers: list[Any] = [(b"content-type", b"application/json"),
                          (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if error.status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
