"""A request's choices, end to end across the workers: each choice's PD flow, its tokens
decoded and batched into events, the choices' events merged into one stream.

``Generation`` starts every choice of one API request together. Workers are picked for every
choice before anything is sent, so "no worker available" is a plain 503 even for a streaming
request. Cancelling the generation (the client went away, or one choice failed) aborts every
choice's room on its workers.

``ChoiceRun`` is one choice, in the messages of ``pdserve.worker_api``: POST /generate to the
decode worker with the prefill worker's URL; its first line (``RoomLine``) names the room's KV
blocks; POST /prefill to the prefill worker with them (concurrently; a failed prefill answers an
error status); then read ``TokenLine``s from decode until a finish. Colocated: /generate with
``prefill_url: None``.

A choice whose worker fails it (the process died, refused it, or lost its prefill peer: a 503)
runs again, ``Services.retries`` times at most, on the route admission gives it, under a new room
id (the workers refuse an id they have seen): from the start when the client has seen nothing of
it, else from its last token: the tokens so far are appended to the prompt and marked as its
output, so that penalties, a grammar and a seed go on as they were (``ChoiceRun.resumable``);
docs/supervision.md.

Every token goes through the choice's ``OutputDecoder`` one at a time; deltas are grouped by a
``DeltaBatcher`` (the first token alone, then up to N per event; see ``DeltaBatcher``) and
handed to the request as ``ChoiceEvent``s. Unless the decode worker itself reported a normal
finish, the room is aborted on both workers when the choice ends, whatever
ended it; the abort's origin (``pdserve.metrics.ABORT_ORIGINS``) says what: "router" (a stop
string, or another choice of the request failed), "client" (it went away), "peer" (a worker
failed or died), "drain" (the router shut down before the choice finished).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.frontend.errors import APIError, internal, invalid, unavailable
from pdserve.frontend.output import OutputDecoder, OutputDelta
from pdserve.frontend.worker_client import WorkerClient, WorkerError
from pdserve.frontend.workers import Route, WorkerPool
from pdserve.worker_api import (DecodeTarget, ErrorCode, FinishReason, GenerateRequest, PrefillRequest, Room, RoomLine,
                                SamplingParams, TokenLine, TokenLogprob)

logger = logging.getLogger(__name__)


@dataclass
class Batch:
    """Tokens of one choice sent in one event, with what they added to the message."""

    delta: OutputDelta = field(default_factory=OutputDelta)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the choice's first batch, if asked
    # per token: where its parts end in `delta.parts` (parts after the last token's are text
    # without a token: the decoder's final flush); which token wrote what, for Responses logprobs
    part_ends: list[int] = field(default_factory=list)

    def add(self, token_id: int | None, delta: OutputDelta, logprob: TokenLogprob | None) -> None:
        self.delta.extend(delta)  # in place: a non-streaming choice is one batch of every token
        if token_id is not None:
            self.token_ids.append(token_id)
            self.part_ends.append(len(self.delta.parts))
        if logprob is not None:
            self.logprobs.append(logprob)

    def __bool__(self) -> bool:
        return bool(self.delta) or bool(self.token_ids) or self.prompt_logprobs is not None


class DeltaBatcher:
    """Stream batching: up to N tokens of one choice per event. The first token of a choice
    always goes out alone (time to first token is not traded away), then tokens are grouped N
    at a time; the end of the choice flushes what is left. Tokens are decoded (parsed) one by
    one before batching, so a batch is the concatenation of its tokens' deltas and the
    aggregate is the same for every N."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("batch size must be >= 1")
        self.size = size
        self._batch = Batch()
        self._sent_first = False

    def add(self, token_id: int, delta: OutputDelta, logprob: TokenLogprob | None = None) -> Batch | None:
        """Add one token's delta; return a batch when one is due."""
        self._batch.add(token_id, delta, logprob)
        if not self._sent_first or len(self._batch.token_ids) >= self.size:
            self._sent_first = True
            return self.take()
        return None

    def add_prompt(self, prompt_logprobs: list[TokenLogprob | None]) -> None:
        """The prompt's logprobs (they come with the first token): sent with the next batch."""
        self._batch.prompt_logprobs = prompt_logprobs

    def add_text(self, delta: OutputDelta) -> None:
        """Text without a token (the decoder's final flush)."""
        self._batch.add(None, delta, None)

    def take(self) -> Batch:
        batch, self._batch = self._batch, Batch()
        return batch


@dataclass
class ChoiceSpec:
    index: int            # the choice's index in the response
    request_id: str       # the id the workers know this choice (its room) by
    prompt_ids: list[int]
    params: SamplingParams
    hide_output: bool = False  # max_tokens 0 (scoring): the one token the worker samples is not shown


@dataclass
class ChoiceEvent:
    index: int
    batch: Batch | None = None
    finish_reason: str | None = None   # "stop" | "length" | "tool_calls" on the choice's last event
    error: APIError | None = None      # the choice failed; no further events follow
    num_tokens: int = 0                # tokens generated so far (the completion's usage)
    cached_tokens: int | None = None   # with the finish: prompt tokens reused from a prefix cache
    stop_sequence: str | None = None   # with a "stop" finish: the stop string that ended the text
    stop_token: int | None = None      # ... or the request's stop token id that ended it

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Placer(Protocol):
    """Where a choice may run again: the failed route's workers looked at anew, then a route
    admitted as for a new request (admission.py). `pick()` on what it yields gives the route."""

    def readmit(self, failed: Route, prompt_ids: Sequence[int], cache_salt: str | None = None,
                priority: int = 0) -> AbstractAsyncContextManager[Any]: ...


@dataclass
class Services:
    """What a choice needs from the router process."""

    client: WorkerClient
    spawn: Callable[[Coroutine[Any, Any, Any]], None]  # run a task that outlives the request
    abort_timeout_s: float = 2.0
    on_abort: Callable[[str], None] | None = None       # metrics: the origin of each abort
    placer: Placer | None = None                       # None: a failed choice is not run again
    retries: int = 0                                    # how many times one choice may run again
    on_retry: Callable[[], None] | None = None          # metrics


class ChoiceRun:
    """One choice on its workers, from the /generate call to its last event."""

    def __init__(self, spec: ChoiceSpec, route: Route, decoder: OutputDecoder,
                 emit: Callable[[ChoiceEvent], None], services: Services, stream_batch: int = 1) -> None:
        self.spec = spec
        self.decoder = decoder
        self.services = services
        self.batcher = DeltaBatcher(stream_batch)
        self.num_tokens = 0
        self.cached_tokens = 0  # the worker's count, from the last token line
        self.stop_token: int | None = None  # the request's stop token that ended it, if one did
        self.finished = False
        self.prefill_seconds: float | None = None
        self.rid = spec.request_id      # the room id of the current attempt, and what it asks
        self.prompt_ids, self.params = spec.prompt_ids, spec.params
        self.output_ids: list[int] = []  # every token the workers sent
        self.attempts = 1
        self.emit = emit
        self._worker_finished = False   # decode reported stop/length: nothing to abort
        self._failure: APIError | None = None
        self._origin = "client"         # who ended the choice, when not the decode worker
        self._cancelled = False         # cancel() was called: the choice is not wanted any more
        self._task: asyncio.Task[None] | None = None
        self._prefill_task: asyncio.Task[None] | None = None
        self._closed = False
        self._ended = False             # the choice's last event was emitted
        self._enter(route)

    @property
    def priority(self) -> int:
        """The request's `priority` (admission counts the choices a smaller one may preempt)."""
        return self.params.priority

    def _enter(self, route: Route) -> None:
        # Counted on the workers now, so the next pick of the same request sees this one.
        self.route = route
        self._on_route = True
        route.decode.inflight.add(self)
        if route.prefill is not None:
            route.prefill.inflight.add(self)

    def _leave(self, origin: str) -> None:
        """Leave the route's in-flight sets; abort the room unless decode finished it (or it was
        never started). Once per route."""
        if not self._on_route:
            return
        self._on_route = False
        self.route.decode.inflight.discard(self)
        if self.route.prefill is not None:
            self.route.prefill.inflight.discard(self)
        if self._prefill_task is not None and not self._prefill_task.done():
            self._prefill_task.cancel()
        if not self._worker_finished and self._task is not None:
            self._abort_everywhere(origin)

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
        self._cancelled = True
        if self._task is not None and not self._task.done():
            if self._failure is None:
                self._origin = origin
            self._task.cancel()
        elif self._task is None:
            self.close()

    async def run(self) -> None:
        try:
            while (error := await self._attempt()) is not None:
                if not await self._retry(error):
                    self._end_with_error(error)
                    return
        except asyncio.CancelledError:
            if self._failure is None:
                raise
            self._end_with_error(self._failure)  # fail() while a retry waited for a route
        except Exception as e:  # a bug of ours: the client gets a 500 now, not a stream that never ends
            logger.exception("[%s] the choice failed inside the router", self.rid)
            self._end_with_error(internal(f"the router failed this request: {type(e).__name__}: {e}"))
        finally:
            self.close()

    async def _attempt(self) -> APIError | None:
        """The choice on its current route: None once it finished, else why it failed."""
        try:
            await self._stream()
            return None
        except asyncio.CancelledError:
            if self._failure is None:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # we cancelled ourselves in fail(): an outcome, not the task's end
            return self._failure
        except WorkerError as e:
            return self._failed_by_worker(invalid(e.message) if e.status == 400 else unavailable(e.message))
        except APIError as e:
            return self._failed_by_worker(e)

    @property
    def resumable(self) -> bool:
        """Whether the choice can go on from its last token elsewhere: its tokens so far are
        appended to the prompt and marked as its output (``SamplingParams.resumed_tokens``), so
        the new worker's penalties count them, its grammar reads them and a seed draws on from
        there. The next token's distribution is the same (up to near-ties: the tokens' KV is now
        computed as a prompt). A scoring choice (max_tokens 0) shows no token to go on from."""
        return not self.spec.hide_output and len(self.output_ids) < self.spec.params.max_tokens

    async def _retry(self, error: APIError) -> bool:
        """Run the choice again elsewhere when a worker failed it (503): from the start when
        nothing of it went out, else from its last token when it is `resumable`. True once it
        runs on a new route."""
        placer = self.services.placer
        started = bool(self.output_ids)  # the decoder (and maybe the client) has seen tokens
        if (placer is None or self.attempts > self.services.retries or self._cancelled
                or error.status != 503 or self._origin != "peer" or (started and not self.resumable)):
            return False
        failed = self.route
        self._leave("peer")
        self.rid = f"{self.spec.request_id}~r{self.attempts}"
        self.attempts += 1
        self._failure, self._origin, self._prefill_task = None, "client", None
        if started:
            n, p = len(self.output_ids), self.spec.params
            self.prompt_ids = [*self.spec.prompt_ids, *self.output_ids]
            self.params = dataclasses.replace(p, max_tokens=p.max_tokens - n, min_tokens=max(0, p.min_tokens - n),
                                              prompt_logprobs=None, resumed_tokens=n)
        logger.warning("[%s] %s failed after %d token(s) (%s); going on as %s", self.spec.request_id,
                       route_text(failed), len(self.output_ids), error.message, self.rid)
        try:
            async with placer.readmit(failed, self.prompt_ids, self.params.cache_salt, self.params.priority) as ticket:
                self._enter(ticket.pick())
        except APIError as refused:
            logger.warning("[%s] no route to run it again: %s", self.spec.request_id, refused.message)
            self._failure, self._origin = error, "peer"
            return False
        if self.services.on_retry is not None:
            self.services.on_retry()
        logger.info("[%s] running again on %s", self.rid, route_text(self.route))
        return True

    def _failed_by_worker(self, error: APIError) -> APIError:
        if self._failure is None:
            self._failure, self._origin = error, "peer"
        return self._failure

    def close(self) -> None:
        """The choice is over: leave its route (abort its room unless decode finished it).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._leave("router" if self.finished else self._origin)

    # ---- the PD flow -----------------------------------------------------------------------------

    async def _stream(self) -> None:
        decode, prefill = self.route
        body = GenerateRequest(request_id=self.rid, prompt_ids=self.prompt_ids, params=self.params,
                               prefill_url=prefill.url if prefill is not None else None,
                               prefill_worker_id=prefill.worker_id if prefill is not None else None,
                               prefill_incarnation=prefill.incarnation if prefill is not None else None)
        async with self.services.client.generate(decode.url, body) as lines:
            async for line in lines:
                if isinstance(line, RoomLine):
                    self._start_prefill(line.room)
                elif self._on_tokens(line):
                    return
        raise WorkerError(f"decode worker {decode.url} closed the stream before the request finished")

    def _start_prefill(self, room: Room) -> None:
        prefill = self.route.prefill
        if prefill is None or self._prefill_task is not None:
            logger.warning("[%s] unexpected room line from %s; ignored", self.rid, self.route.decode.url)
            return
        body = PrefillRequest(request_id=self.rid, prompt_ids=self.prompt_ids, params=self.params,
                              decode=DecodeTarget(worker_id=room.worker_id,
                                                  decode_url=room.decode_url or self.route.decode.url,
                                                  blocks=room.blocks, incarnation=self.route.decode.incarnation,
                                                  cached_blocks=room.cached_blocks))
        self._prefill_task = asyncio.create_task(self._prefill(prefill.url, body), name=f"prefill-{self.rid}")

    async def _prefill(self, url: str, body: PrefillRequest) -> None:
        started = time.monotonic()
        try:
            await self.services.client.prefill(url, body)
        except WorkerError as e:
            if e.code is not None and e.code.prefill_failure:
                logger.warning("[%s] prefill on %s reported failure: %s", self.rid, url, e.message)
                # the decode worker gone (unreachable, or died under the transfer): a worker died
                # under the request, as when its stream breaks, so 503 and the client may retry
                gone = e.code is ErrorCode.DECODE_UNREACHABLE
                self.fail((unavailable if gone else internal)(f"prefill failed: {e.message}"))
            else:
                logger.warning("[%s] prefill on %s failed: %s", self.rid, url, e.message)
                self.fail(invalid(e.message) if e.status == 400 else unavailable(e.message))
            return
        self.prefill_seconds = time.monotonic() - started
        if self.route.prefill is not None:  # decoding no longer depends on the prefill worker
            self.route.prefill.inflight.discard(self)
        logger.debug("[%s] prefill done on %s in %.3f s", self.rid, url, self.prefill_seconds)

    def _on_tokens(self, line: TokenLine) -> bool:
        """Feed one token line; True once the choice is over."""
        logprobs = line.logprobs or []
        self.output_ids += line.token_ids
        if line.prompt_logprobs is not None:
            self.batcher.add_prompt(line.prompt_logprobs)
        for k, token_id in enumerate([] if self.spec.hide_output else line.token_ids):
            logprob = logprobs[k] if k < len(logprobs) else None
            self.num_tokens += 1
            batch = self.batcher.add(token_id, self.decoder.push(token_id), logprob)
            if batch is not None:
                self.emit(ChoiceEvent(self.spec.index, batch, num_tokens=self.num_tokens))
            if self.decoder.stopped:
                logger.debug("[%s] stop string after %d tokens", self.rid, self.num_tokens)
                self._finish("stop")
                return True
        reason = line.finish_reason
        if reason is not None and reason.normal:
            # a choice that went on elsewhere: the worker counts its tokens so far as prompt
            self.cached_tokens = min(line.cached_tokens or 0, len(self.spec.prompt_ids))
            self._worker_finished = True
            last = self.output_ids[-1] if self.output_ids else None
            if reason is FinishReason.STOP and last in self.spec.params.stop_token_ids:
                self.stop_token = last  # not the model's own end: vLLM's stop_reason names it
            self._finish("length" if self.spec.hide_output else reason.value)
            return True
        if reason is not None:
            why = line.error or f"the worker ended the request ({reason.value})"
            # the prefill worker died under the KV transfer, or a rank of this worker died: a
            # worker died under the request (503, and it may run again elsewhere)
            died = line.peer_dead or line.worker_died
            raise (internal(why) if reason is FinishReason.ERROR and not died else unavailable(why))
        return False

    def _finish(self, reason: str) -> None:
        self.batcher.add_text(self.decoder.finish(reason))  # may raise: tool_choice not satisfied
        self.finished = self._ended = True
        reason = self.decoder.finish_reason or reason        # e.g. "tool_calls"
        self.emit(ChoiceEvent(self.spec.index, self.batcher.take(), reason, num_tokens=self.num_tokens,
                              cached_tokens=self.cached_tokens, stop_sequence=self.decoder.stop_sequence,
                              stop_token=self.stop_token))

    def _end_with_error(self, error: APIError) -> None:
        self._ended = True
        logger.warning("[%s] choice failed after %d tokens: %s", self.rid, self.num_tokens, error.message)
        self.emit(ChoiceEvent(self.spec.index, error=error, num_tokens=self.num_tokens))

    def _abort_everywhere(self, origin: str) -> None:
        urls = [self.route.decode.url] + ([self.route.prefill.url] if self.route.prefill else [])
        logger.info("[%s] aborting on %s (origin: %s)", self.rid, ", ".join(urls), origin)
        if self.services.on_abort is not None:
            self.services.on_abort(origin)
        self.services.spawn(self._send_aborts(urls, self.rid, origin))

    async def _send_aborts(self, urls: list[str], rid: str, origin: str) -> None:
        client, timeout = self.services.client, self.services.abort_timeout_s
        await asyncio.gather(*(client.abort(u, rid, timeout, origin) for u in urls))


def route_text(route: Route) -> str:
    """`prefill -> decode` in PD, the one worker colocated."""
    return f"{route.prefill.url} -> {route.decode.url}" if route.prefill is not None else route.decode.url


class Generation:
    """One API request's choices, started together, their events merged into one queue."""

    def __init__(self, specs: list[ChoiceSpec], make_decoder: Callable[[ChoiceSpec], OutputDecoder],
                 pool: WorkerPool, services: Services, stream_batch: int = 1) -> None:
        self.queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        self.runs: list[ChoiceRun] = []
        try:
            for spec in specs:
                self.runs.append(ChoiceRun(spec, pool.pick(), make_decoder(spec), self.queue.put_nowait,
                                           services, stream_batch))
        except APIError:
            self.cancel()
            raise

    def start(self) -> None:
        for run in self.runs:
            run.start()

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's events in arrival order, until each choice has ended."""
        left = len(self.runs)
        while left:
            ev = await self.queue.get()
            left -= ev.last
            yield ev

    def cancel(self, origin: str = "client") -> None:
        """Stop what still runs (idempotent; a no-op for choices that ended). `origin`: who
        stopped it, for the abort metrics ("client": the client left)."""
        for run in self.runs:
            run.cancel(origin)

    def fail(self, error: APIError, origin: str) -> None:
        """End every choice still running with `error` (its client gets it)."""
        for run in self.runs:
            run.fail(error, origin)
