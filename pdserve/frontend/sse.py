"""Server-sent events as OpenAI streams them: ``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``."""
from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.frontend.errors import APIError

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(error: APIError) -> str:
    """The last event of a stream that failed: an OpenAI error object (no [DONE] follows)."""
    return event(error.body())


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its generator when it ends, however it ends.

    Starlette stops iterating when the client disconnects; the generator is closed at once (not
    whenever it is collected) and ``on_close`` runs, which aborts the request on the workers.
    """

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], None] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type=MEDIA_TYPE, headers={**HEADERS, **(headers or {})})
        self._generator = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._generator.aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()
