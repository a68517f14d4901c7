"""One ASGI middleware for what every request gets before a handler runs.

* the request id: X-Request-Id accepted (or made), stored in ``scope["state"]`` with the
  arrival time, and sent back;
* the API key: ``Authorization: Bearer <key>`` on /v1/* when the router has one (401 otherwise);
* the body limit: 413 for a Content-Length over the limit, or once more bytes than that arrive;
* the request count for requests that never reach a generation (errors, /v1/models).
"""
from __future__ import annotations

import hmac
import json
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.frontend.errors import APIError, bad_api_key, too_large
from pdserve.frontend.ids import RequestIds
from pdserve.frontend.metrics import RouterMetrics


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int, metrics: RouterMetrics) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body = max_body
        self.metrics = metrics

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
        try:
            state["request_id"] = RequestIds.client_id(headers.get("x-request-id"))
            if path.startswith("/v1/") and self.api_key is not None and not self._authorized(headers):
                raise bad_api_key()
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                raise too_large(self.max_body)
        except APIError as e:
            await _send_error(send_with_id, e)
        else:
            await self.app(scope, self._limited(receive), send_with_id)
        finally:
            if path.startswith("/v1/") and not state.get("counted") and status_seen:
                self.metrics.requests.labels(path, str(status_seen[0])).inc()

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


async def _send_error(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers: list[Any] = [(b"content-type", b"application/json"),
                          (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
