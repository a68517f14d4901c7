"""Run a request's choices and answer: a JSON body, or an SSE stream.

Non-streaming: wait for every choice (or the first error, answered with its status), while
watching for the client to go away. Streaming: the opening chunks, one chunk per event, the
usage chunk if asked, ``[DONE]``; an error mid-stream is sent as an error event and the stream
closed. Either way, leaving early cancels the generation, which aborts the rooms.
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
from pdserve.frontend.errors import APIError
from pdserve.frontend.generation import Generation
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
    batch = router.config.stream_batch if stream else 1 << 30
    gen = Generation(specs, make_decoder, router.pool, router.services, batch)  # 503 before start
    logger.info("[%s] %s: %d choice(s), %d prompt tokens, stream=%s, workers %s", call.request_id,
                call.endpoint, len(specs), renderer.prompt_tokens, stream,
                ", ".join(sorted({r.route.decode.url for r in gen.runs})))
    gen.start()
    tracker = _Tracker(router, call, renderer, gen)
    if stream:
        return sse.SSEResponse(_stream(gen, renderer, tracker), on_close=tracker.finish)
    return await _collect(gen, renderer, tracker, call.http)


async def _stream(gen: Generation, renderer: ChatRenderer | CompletionRenderer,
                  tracker: _Tracker) -> AsyncGenerator[str, None]:
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
        chunk = renderer.absorb(ev)
        if chunk is not None:
            yield sse.event(chunk)
    if renderer.include_usage:
        yield sse.event(renderer.usage_chunk())
    yield sse.DONE
    tracker.status = 200


async def _collect(gen: Generation, renderer: ChatRenderer | CompletionRenderer, tracker: _Tracker,
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
            return JSONResponse(error.body(), status_code=error.status)
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


class _Tracker:
    """The end of one call: stop what still runs, count it, log it (once)."""

    def __init__(self, router: Router, call: Call, renderer: ChatRenderer | CompletionRenderer,
                 gen: Generation) -> None:
        self.router = router
        self.call = call
        self.renderer = renderer
        self.gen = gen
        self.status = CLIENT_CLOSED  # until the call ends otherwise
        self.first_token: float | None = None
        self._finished = False
        call.http.state.counted = True  # the middleware leaves the request count to us
        router.metrics.running.inc()

    def saw(self, ev: ChoiceEvent) -> None:
        if self.first_token is None and ev.batch is not None and ev.batch.token_ids:
            self.first_token = time.monotonic()
            self.router.metrics.ttft.observe(self.first_token - self.call.arrival)

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self.gen.cancel()  # a no-op for choices that ended; aborts the rooms of the others
        m = self.router.metrics
        m.running.dec()
        elapsed = time.monotonic() - self.call.arrival
        m.requests.labels(self.call.endpoint, str(self.status)).inc()
        m.e2e.observe(elapsed)
        m.prompt_tokens.inc(self.renderer.prompt_tokens)
        m.generation_tokens.inc(self.renderer.completion_tokens)
        for seconds in self.gen.prefill_seconds:
            m.prefill.observe(seconds)
        ttft = f"{self.first_token - self.call.arrival:.3f}s" if self.first_token else "-"
        logger.info("[%s] %s done: status %d, %d completion tokens, ttft %s, e2e %.3fs",
                    self.call.request_id, self.call.endpoint, self.status, self.renderer.completion_tokens,
                    ttft, elapsed)
