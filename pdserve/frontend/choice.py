"""One choice of one request, end to end across the workers.

PD flow: POST /generate to the decode worker with the prefill worker's URL; its first line names
the room's KV blocks; POST /prefill to the prefill worker with them (concurrently); then read
token lines from decode until a finish. Colocated: /generate with ``prefill_url: null``.

Every token goes through the choice's ``OutputDecoder`` one at a time; deltas are grouped by a
``DeltaBatcher`` and handed to the request as ``ChoiceEvent``s. Unless the decode worker itself
reported a normal finish, the room is aborted on both workers when the choice ends, whatever
ended it; the abort's origin (``pdserve.metrics.ABORT_ORIGINS``) says what: "router" (a stop
string, or another choice of the request failed), "client" (it went away), "peer" (a worker
failed or died), "drain" (the router shut down before the choice finished).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.frontend.backend import WorkerClient, WorkerError
from pdserve.frontend.batching import Batch, DeltaBatcher
from pdserve.frontend.errors import APIError, internal, invalid, unavailable
from pdserve.frontend.output import OutputDecoder, TokenLogprob
from pdserve.frontend.params import worker_params
from pdserve.frontend.workers import Route

logger = logging.getLogger(__name__)


@dataclass
class ChoiceSpec:
    index: int            # the choice's index in the response
    request_id: str       # the id the workers know this choice (its room) by
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class ChoiceEvent:
    index: int
    batch: Batch | None = None
    finish_reason: str | None = None   # "stop" | "length" | "tool_calls" on the choice's last event
    error: APIError | None = None      # the choice failed; no further events follow
    num_tokens: int = 0                # tokens generated so far (the completion's usage)

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class Services:
    """What a choice needs from the router process."""

    client: WorkerClient
    spawn: Callable[[Coroutine[Any, Any, Any]], None]  # run a task that outlives the request
    abort_timeout_s: float = 2.0
    on_abort: Callable[[str], None] | None = None       # metrics: the origin of each abort


class ChoiceRun:
    def __init__(self, spec: ChoiceSpec, route: Route, decoder: OutputDecoder,
                 emit: Callable[[ChoiceEvent], None], services: Services, stream_batch: int = 1) -> None:
        self.spec = spec
        self.route = route
        self.decoder = decoder
        self.emit = emit
        self.services = services
        self.batcher = DeltaBatcher(stream_batch)
        self.num_tokens = 0
        self.finished = False
        self.prefill_seconds: float | None = None
        self._worker_finished = False   # decode reported stop/length: nothing to abort
        self._failure: APIError | None = None
        self._origin = "client"         # who ended the choice, when not the decode worker
        self._task: asyncio.Task[None] | None = None
        self._prefill_task: asyncio.Task[None] | None = None
        self._closed = False
        self._ended = False             # the choice's last event was emitted
        # Counted on the workers now, so the next pick of the same request sees this one.
        route.decode.inflight.add(self)
        if route.prefill is not None:
            route.prefill.inflight.add(self)

    @property
    def rid(self) -> str:
        return self.spec.request_id

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self.run(), name=f"choice-{self.rid}")
        self._task.add_done_callback(self._on_done)
        return self._task

    def _on_done(self, _: asyncio.Task[None]) -> None:
        # A task cancelled before its first step never ran `run`: end it here either way.
        if self._failure is not None and not self._ended:
            self._end_with_error(self._failure)
        self.close()

    def fail(self, error: APIError, origin: str = "peer") -> None:
        """Stop this choice with `error` (a worker died, prefill failed, the router drains).
        Idempotent."""
        if self.finished or self._failure is not None:
            return
        self._failure, self._origin = error, origin
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def cancel(self, origin: str = "client") -> None:
        """The request is gone: its client left ("client"), or another choice failed ("router")."""
        if self._task is not None and not self._task.done():
            if self._failure is None:
                self._origin = origin
            self._task.cancel()
        elif self._task is None:
            self.close()

    async def run(self) -> None:
        try:
            await self._stream()
        except asyncio.CancelledError:
            if self._failure is None:
                raise
            self._end_with_error(self._failure)  # we cancelled ourselves in fail()
        except WorkerError as e:
            error = invalid(e.message) if e.status == 400 else unavailable(e.message)
            self._end_with_error(self._failed_by_worker(error))
        except APIError as e:
            self._end_with_error(self._failed_by_worker(e))
        finally:
            self.close()

    def _failed_by_worker(self, error: APIError) -> APIError:
        if self._failure is None:
            self._failure, self._origin = error, "peer"
        return self._failure

    def close(self) -> None:
        """Leave the workers' in-flight sets; abort the room unless decode finished it (or it
        was never started). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.route.decode.inflight.discard(self)
        if self.route.prefill is not None:
            self.route.prefill.inflight.discard(self)
        if self._prefill_task is not None and not self._prefill_task.done():
            self._prefill_task.cancel()
        if not self._worker_finished and self._task is not None:
            self._abort_everywhere("router" if self.finished else self._origin)

    # ---- the PD flow -----------------------------------------------------------------------------

    async def _stream(self) -> None:
        decode, prefill = self.route
        body = {"request_id": self.rid, "prompt_ids": self.spec.prompt_ids,
                "params": worker_params(self.spec.params),
                "prefill_url": prefill.url if prefill is not None else None,
                "prefill_worker_id": prefill.worker_id if prefill is not None else None}
        async with self.services.client.generate(decode.url, body) as lines:
            async for msg in lines:
                if "room" in msg:
                    self._start_prefill(msg["room"])
                elif self._on_tokens(msg):
                    return
        raise WorkerError(f"decode worker {decode.url} closed the stream before the request finished")

    def _start_prefill(self, room: Any) -> None:
        prefill = self.route.prefill
        if prefill is None or self._prefill_task is not None:
            logger.warning("[%s] unexpected room line from %s; ignored", self.rid, self.route.decode.url)
            return
        if not isinstance(room, dict) or not isinstance(room.get("blocks"), list):
            raise WorkerError(f"decode worker {self.route.decode.url} sent a malformed room line")
        body = {"request_id": self.rid, "prompt_ids": self.spec.prompt_ids,
                "params": worker_params(self.spec.params),
                "decode": {"worker_id": room.get("worker_id") or self.route.decode.worker_id,
                           "decode_url": room.get("decode_url") or self.route.decode.url,
                           "blocks": room["blocks"]}}
        self._prefill_task = asyncio.create_task(self._prefill(prefill.url, body),
                                                 name=f"prefill-{self.rid}")

    async def _prefill(self, url: str, body: dict[str, Any]) -> None:
        started = time.monotonic()
        try:
            result = await self.services.client.prefill(url, body)
        except WorkerError as e:
            logger.warning("[%s] prefill on %s failed: %s", self.rid, url, e.message)
            self.fail(invalid(e.message) if e.status == 400 else unavailable(e.message))
            return
        if result.get("status") != "done":
            why = result.get("error") or result.get("status") or "unknown error"
            logger.warning("[%s] prefill on %s reported failure: %s", self.rid, url, why)
            self.fail(internal(f"prefill failed: {why}"))
            return
        self.prefill_seconds = time.monotonic() - started
        if self.route.prefill is not None:  # decoding no longer depends on the prefill worker
            self.route.prefill.inflight.discard(self)
        logger.debug("[%s] prefill done on %s in %.3f s", self.rid, url, self.prefill_seconds)

    def _on_tokens(self, msg: dict[str, Any]) -> bool:
        """Feed one token line; True once the choice is over."""
        ids = msg.get("token_ids") or []
        logprobs = msg.get("logprobs") or []
        for k, token_id in enumerate(ids):
            logprob = TokenLogprob.from_wire(logprobs[k]) if k < len(logprobs) and logprobs[k] else None
            self.num_tokens += 1
            batch = self.batcher.add(int(token_id), self.decoder.push(int(token_id)), logprob)
            if batch is not None:
                self.emit(ChoiceEvent(self.spec.index, batch, num_tokens=self.num_tokens))
            if self.decoder.stopped:
                logger.debug("[%s] stop string after %d tokens", self.rid, self.num_tokens)
                self._finish("stop")
                return True
        reason = msg.get("finish_reason")
        if reason in ("stop", "length"):
            self._worker_finished = True
            self._finish(reason)
            return True
        if reason is not None:
            why = msg.get("error") or f"the worker ended the request ({reason})"
            raise (internal(str(why)) if reason == "error" else unavailable(str(why)))
        return False

    def _finish(self, reason: str) -> None:
        self.batcher.add_text(self.decoder.finish(reason))  # may raise: tool_choice not satisfied
        self.finished = self._ended = True
        reason = self.decoder.finish_reason or reason        # e.g. "tool_calls"
        self.emit(ChoiceEvent(self.spec.index, self.batcher.take(), reason, num_tokens=self.num_tokens))

    def _end_with_error(self, error: APIError) -> None:
        self._ended = True
        logger.warning("[%s] choice failed after %d tokens: %s", self.rid, self.num_tokens, error.message)
        self.emit(ChoiceEvent(self.spec.index, error=error, num_tokens=self.num_tokens))

    def _abort_everywhere(self, origin: str) -> None:
        urls = [self.route.decode.url] + ([self.route.prefill.url] if self.route.prefill else [])
        logger.info("[%s] aborting on %s (origin: %s)", self.rid, ", ".join(urls), origin)
        if self.services.on_abort is not None:
            self.services.on_abort(origin)
        self.services.spawn(self._send_aborts(urls, origin))

    async def _send_aborts(self, urls: list[str], origin: str) -> None:
        client, timeout = self.services.client, self.services.abort_timeout_s
        await asyncio.gather(*(client.abort(u, self.rid, timeout, origin) for u in urls))
