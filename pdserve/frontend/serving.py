"""Run a request's choices and answer: a JSON body, or an SSE stream.

Non-streaming: wait for every choice (or the first error, answered with its status), while
watching for the client to go away. Streaming: the opening chunks, one chunk per event, the
usage chunk if asked, ``[DONE]``; an error mid-stream is sent as an error event and the stream
closed. Either way, leaving early cancels the generation, which aborts the rooms.

Each call is registered with the router (``Router.calls``) from its start to its end, so a
drain can wait for it or stop it (``CallTracker.stop``), and is counted in the router's metrics.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.frontend import sse
from pdserve.frontend.choice import ChoiceEvent, ChoiceSpec
from pdserve.frontend.errors import APIError, unavailable
from pdserve.frontend.generation import Generation
from pdserve.frontend.middleware import RETRY_AFTER_S
from pdserve.frontend.output import OutputDecoder
from pdserve.frontend.render import ChatRenderer, CompletionRenderer

if TYPE_CHECKING:
    from pdserve.frontend.server import Router

logger = logging.getLogger(__name__)
CLIENT_CLOSED = 499  # nginx's status for "the client closed the request"


@dataclass
class Call:
    """One API call as the handlers see it."""

    endpoint: str        # the path, e.g. /v1/chat/completions (the metrics' label)
    request_id: str      # the X-Request-Id answered with
    room_base: str       # the workers' id for it (per choice: <room_base>-<i>)
    http: Request
    arrival: float


async def respond(router: Router, call: Call, specs: list[ChoiceSpec],
                  make_decoder: Callable[[ChoiceSpec], OutputDecoder],
                  renderer: ChatRenderer | CompletionRenderer, stream: bool) -> Response:
    if router.closing:  # the drain timeout passed while this request was being read
        raise unavailable("The server is shutting down; retry the request.")
    batch = router.config.stream_batch if stream else 1 << 30
    gen = Generation(specs, make_decoder, router.pool, router.services, batch)  # 503 before start
    logger.info("[%s] %s: %d choice(s), %d prompt tokens, stream=%s, workers %s", call.request_id,
                call.endpoint, len(specs), renderer.prompt_tokens, stream,
                ", ".join(sorted({r.route.decode.url for r in gen.runs})))
    gen.start()
    tracker = CallTracker(router, call, renderer, gen)
    if stream:
        return sse.SSEResponse(_stream(gen, renderer, tracker), on_close=tracker.finish)
    return await _collect(gen, renderer, tracker, call.http)


async def _stream(gen: Generation, renderer: ChatRenderer | CompletionRenderer,
                  tracker: CallTracker) -> AsyncGenerator[str, None]:
    """The SSE body. Its end, however it comes, is handled by `tracker.finish` (the response
    calls it even when the client left before the first byte and this never ran)."""
    for chunk in renderer.opening():
        yield sse.event(chunk)
    async for ev in gen.events():
        tracker.saw(ev)
        if ev.error is not None:
            tracker.status = ev.error.status
            yield sse.error_event(ev.error)
            return
        for chunk in renderer.absorb(ev):
            yield sse.event(chunk)
    if renderer.include_usage:
        yield sse.event(renderer.usage_chunk())
    yield sse.DONE
    tracker.status = 200


async def _collect(gen: Generation, renderer: ChatRenderer | CompletionRenderer, tracker: CallTracker,
                   http: Request) -> Response:
    async def run() -> APIError | None:
        async for ev in gen.events():
            tracker.saw(ev)
            if ev.error is not None:
                return ev.error
            renderer.absorb(ev)
        return None

    work = asyncio.create_task(run())
    gone = asyncio.create_task(_disconnected(http))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            logger.info("[%s] client went away; aborting", tracker.call.request_id)
            return Response(status_code=CLIENT_CLOSED)
        error = work.result()
        if error is not None:
            tracker.status = error.status
            retry = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
            return JSONResponse(error.body(), status_code=error.status, headers=retry)
        tracker.status = 200
        return JSONResponse(renderer.response())
    finally:
        work.cancel()
        gone.cancel()
        tracker.finish()


async def _disconnected(http: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


class CallTracker:
    """One call from its start to its end: stop what still runs, count it, log it (once)."""

    def __init__(self, router: Router, call: Call, renderer: ChatRenderer | CompletionRenderer,
                 gen: Generation) -> None:
        self.router = router
        self.call = call
        self.renderer = renderer
        self.gen = gen
        self.status = CLIENT_CLOSED  # until the call ends otherwise
        self.stopped = False         # ended by the router's drain
        self.first_token: float | None = None
        self.timer = router.metrics.start_request(renderer.prompt_tokens, call.arrival)
        self._finished = False
        router.calls.add(self)

    def saw(self, ev: ChoiceEvent) -> None:
        if ev.batch is not None and ev.batch.token_ids:
            if self.first_token is None:
                self.first_token = time.monotonic()
            self.timer.tokens(len(ev.batch.token_ids), ev.index)

    def stop(self, error: APIError) -> None:
        """The router drains and time is up: every choice still running ends with `error`."""
        self.stopped = True
        self.gen.fail(error, "drain")

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self.router.calls.discard(self)
        # A no-op for choices that ended; aborts the rooms of the others.
        self.gen.cancel("client" if self.status == CLIENT_CLOSED else "router")
        self.timer.finish(self._reason())
        elapsed = time.monotonic() - self.call.arrival
        ttft = f"{self.first_token - self.call.arrival:.3f}s" if self.first_token else "-"
        logger.info("[%s] %s done: status %d, %d completion tokens, ttft %s, e2e %.3fs",
                    self.call.request_id, self.call.endpoint, self.status, self.renderer.completion_tokens,
                    ttft, elapsed)

    def _reason(self) -> str:
        """The call's finish reason for the metrics: the choices' as the client saw them (the
        strongest when they differ), "abort" when the client left or the drain stopped it."""
        if self.status == 200:
            reasons = {c.finish_reason for c in self.renderer.choices}
            return next((r for r in ("tool_calls", "length") if r in reasons), "stop")
        return "abort" if self.status == CLIENT_CLOSED or self.stopped else "error"
