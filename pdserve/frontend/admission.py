"""Admission control: a request runs only where there is room, waits a bounded time in a fair
queue when there is none, and is then refused with 429 — never an unbounded queue, never a 503
because a worker is busy (docs/liveness.md).

Room is counted in choices (a request with ``n`` choices needs ``n``). A worker has room while
its requests (queued and running, as it last reported or as the router counts them, plus those
admitted for it and not yet started) stay under its capacity: ``--worker-capacity``, else
``QUEUE_FACTOR`` × the ``max_num_seqs`` it reports in /info; and not while its last report shows
requests waiting with no free KV block. ``--max-running`` bounds the router as a whole.

A request that finds no room joins a FIFO queue of at most ``--max-queue`` requests; only the
head is admitted (a large request is not overtaken by small ones forever). With
``--scheduling-policy priority`` the queue is ordered by each request's ``priority`` (lower first,
vLLM's convention; FIFO among equals): a request goes before every waiting one of a larger
priority, and when the queue is full it takes the place of the last waiting one of a larger
priority, which gets the 429. Under that policy a worker that is full also takes a request for
each of this router's requests there of a larger priority (at most its capacity again): the
worker's scheduler preempts one of them for it, or runs it beside them. Room is looked for
again whenever a request leaves a worker, a probe reports, or the pool's watch ticks. After
``--queue-timeout`` seconds in the queue, or at once when the queue is full, the request gets
429 with ``Retry-After``. When no worker of a needed role is alive at all (all refused, failed,
or silent past the bound) and none is being restarted, waiting cannot help: 503, for a new
request at once and for those already queued the moment the last such worker goes.

Workers are picked at admission (routing.py: by cached prefix and load, the prompt's token ids
being the routing key) and reserved (``WorkerEndpoint.reserved``) until the request's choices
are registered on them, so two requests admitted back to back cannot take one slot.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from pdserve.frontend.errors import APIError, overloaded, unavailable
from pdserve.frontend.routing import CacheAwareRouter, Policy, PromptKey
from pdserve.frontend.workers import Route, WorkerEndpoint, WorkerPool
from pdserve.worker_api import Role

logger = logging.getLogger(__name__)

SCHEDULING_POLICIES = ("fcfs", "priority")
QUEUE_FACTOR = 2          # a worker may hold this many times its max_num_seqs (one batch waits)
FALLBACK_CAPACITY = 64    # a worker that reports no max_num_seqs


class Rejection(str, enum.Enum):
    """Why a request was refused (the metrics' label)."""

    QUEUE_FULL = "queue_full"        # --max-queue requests already wait
    QUEUE_TIMEOUT = "queue_timeout"  # it waited --queue-timeout seconds without room
    TOO_LARGE = "too_large"          # it needs more room than the router can ever give
    NO_WORKER = "no_worker"          # no worker of a needed role is alive (503)


@dataclass
class AdmissionConfig:
    max_queue: int = 256                 # requests waiting for room, router-wide
    queue_timeout_s: float = 30.0        # how long one may wait before its 429
    worker_capacity: int | None = None   # choices queued + running per worker (None: from /info)
    max_running: int | None = None       # choices running router-wide (None: the workers' sum)
    retry_after_s: int = 2               # what a 429 tells the client
    routing: str = Policy.CACHE_AWARE.value  # --routing: cache-aware | least-loaded (routing.py)
    ask_caches: bool = True              # cache-aware: ask the workers what they hold first (--no-ask-caches)
    local_prefill_tokens: int = 0        # --local-prefill-tokens (routing.py: Placement.local)
    scheduling_policy: str = "fcfs"      # --scheduling-policy: fcfs | priority (requests' `priority`)

    def __post_init__(self) -> None:
        Policy(self.routing)  # a ValueError names the unknown policy
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {self.scheduling_policy!r}: "
                             f"one of {', '.join(SCHEDULING_POLICIES)}")
        if self.max_queue < 0 or self.queue_timeout_s < 0:
            raise ValueError("--max-queue and --queue-timeout must be >= 0")
        for name in ("worker_capacity", "max_running"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")


class AdmissionStats:
    """What the metrics read: queue length now, time queued, rejections by reason."""

    def __init__(self) -> None:
        self.rejected: dict[Rejection, int] = {r: 0 for r in Rejection}
        self.admitted = 0
        self.queued_seconds: list[float] = []  # drained by the metrics (bounded below)
        self.on_wait: Callable[[float], None] | None = None
        self.on_reject: Callable[[str], None] | None = None

    def waited(self, seconds: float) -> None:
        self.admitted += 1
        if self.on_wait is not None:
            self.on_wait(seconds)

    def reject(self, why: Rejection) -> None:
        self.rejected[why] += 1
        if self.on_reject is not None:
            self.on_reject(why.value)


class Ticket:
    """The routes reserved for one admitted request; `Generation` picks from it as from the pool."""

    def __init__(self, routes: list[Route]) -> None:
        self._routes = deque(routes)

    def pick(self) -> Route:
        return self._routes.popleft()


@dataclass(eq=False)
class _Waiter:
    n: int
    since: float
    key: PromptKey | None
    allowed: Callable[[WorkerEndpoint], bool] | None
    priority: int = 0  # lower goes first (--scheduling-policy priority)
    future: asyncio.Future[list[Route]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    """The router's admission queue over its `WorkerPool`."""

    def __init__(self, pool: WorkerPool, config: AdmissionConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.config = config or AdmissionConfig()
        self.clock = clock
        self.stats = AdmissionStats()
        self.routing = CacheAwareRouter(Policy(self.config.routing),
                                        local_prefill_tokens=self.config.local_prefill_tokens)
        self._queue: deque[_Waiter] = deque()
        pool.on_change = self.wake

    @property
    def queued(self) -> int:
        return len(self._queue)

    # ---- room ----------------------------------------------------------------------------------

    def capacity(self, w: WorkerEndpoint) -> int:
        if self.config.worker_capacity is not None:
            return self.config.worker_capacity
        return QUEUE_FACTOR * w.max_num_seqs if w.max_num_seqs else FALLBACK_CAPACITY

    def has_room(self, w: WorkerEndpoint, priority: int = 0) -> bool:
        """Room on `w` for one more choice of `priority`: under its capacity, and not out of KV
        blocks with requests waiting. Under the priority policy a worker holding this router's
        choices of a larger priority takes as many more (at most its capacity again): its
        scheduler preempts them for it, or (a PD decode worker) runs it beside them (README,
        "Priority")."""
        load = w.load
        kv_full = load.total_blocks > 0 and load.free_blocks == 0 and load.waiting > 0
        over = min(self._displaceable(w, priority), self.capacity(w))
        return w.score() < self.capacity(w) + over and (not kv_full or over > 0)

    def _displaceable(self, w: WorkerEndpoint, priority: int) -> int:
        if self.config.scheduling_policy != "priority":
            return 0  # PD too: a prefill worker preempts prompts; a decode worker's rooms run as they land
        return sum(1 for choice in w.inflight if choice.priority > priority)

    def running(self) -> int:
        """Choices admitted and not ended, router-wide (counted on the decode-side workers)."""
        return sum(len(w.inflight) + w.reserved for w in self.pool.workers if w.role is not Role.PREFILL)

    def _take(self, n: int, key: PromptKey | None = None,
              allowed: Callable[[WorkerEndpoint], bool] | None = None, priority: int = 0) -> list[Route] | None:
        """Reserve routes for `n` choices of the prompt `key` and `priority` on workers `allowed`
        (None: any), or None (nothing reserved) when they do not all fit."""
        if self.config.max_running is not None and self.running() + n > self.config.max_running:
            return None
        self.routing.retain(self.pool.workers)
        placement = self.routing.placement(key)
        def fits(w: WorkerEndpoint) -> bool:
            return self.has_room(w, priority) and (allowed is None or allowed(w))

        routes: list[Route] = []
        try:
            for _ in range(n):
                route = self.pool.pick(fits, placement.choose, placement.local)
                _reserve(route, +1)
                routes.append(route)
        except APIError:
            for route in routes:
                _reserve(route, -1)
            placement.discard()
            return None
        placement.commit(routes)
        return routes

    def _alive(self) -> bool:
        """A worker of every needed role is in rotation (maybe slow or full), or being restarted
        by its supervisor: waiting can help."""
        return self.pool.ready or self.pool.recovering

    # ---- the queue -----------------------------------------------------------------------------

    @asynccontextmanager
    async def admit(self, n: int = 1, prompt_ids: Sequence[int] | None = None,
                    cache_salt: str | None = None, priority: int = 0) -> AsyncIterator[Ticket]:
        """Wait (bounded) for room for `n` choices of the prompt `prompt_ids` (the routing key,
        with the request's `cache_salt`, under which the workers cache it), queued by
        `priority` under the priority policy; inside the block, pick their routes from the
        ticket and register the choices on their workers; the reservations end with the block.
        Raises the 429 (or 503) APIError when refused."""
        async with self._admitted(n, prompt_ids, cache_salt, priority, None) as ticket:
            yield ticket

    @asynccontextmanager
    async def readmit(self, failed: Route, prompt_ids: Sequence[int],
                      cache_salt: str | None = None, priority: int = 0) -> AsyncIterator[Ticket]:
        """Room for one choice that `failed`, to run it again (from the start or from its last
        token), admitted like a new request (it may wait for a restarting worker, and gets 429
        or 503 as one would). A worker of the failed route takes it only once it answered a probe asked after
        the failure: the route's workers are probed at once, so a live one is eligible at once,
        while a process that is dying (its streams reset before its port refuses) is not, nor is
        anything else at its URL until it answers."""
        since = self.pool.clock()
        suspects = [w for w in failed if w is not None]
        await self.pool.recheck(suspects)
        def fresh(w: WorkerEndpoint) -> bool:
            return w not in suspects or w.ok_asked_at >= since

        async with self._admitted(1, prompt_ids, cache_salt, priority, fresh) as ticket:
            yield ticket

    @asynccontextmanager
    async def _admitted(self, n: int, prompt_ids: Sequence[int] | None, cache_salt: str | None, priority: int,
                        allowed: Callable[[WorkerEndpoint], bool] | None) -> AsyncIterator[Ticket]:
        key = PromptKey(prompt_ids, cache_salt) if prompt_ids else None
        if key is not None and self.config.ask_caches:
            await self.routing.ask(self.pool.client, self.pool.workers, key)
        routes = await self._wait(_Waiter(n, self.clock(), key, allowed, self._priority(priority)))
        try:
            yield Ticket(routes)
        finally:
            for route in routes:
                _reserve(route, -1)
            self.wake()

    def _priority(self, priority: int) -> int:
        return priority if self.config.scheduling_policy == "priority" else 0

    async def _wait(self, waiter: _Waiter) -> list[Route]:
        n = waiter.n
        cap = self.config.max_running
        if cap is not None and n > cap:
            self.stats.reject(Rejection.TOO_LARGE)
            raise overloaded(f"The request needs {n} sequences; this server runs at most {cap} at once.",
                             self.config.retry_after_s)
        if not self._queue or self._queue[0].priority > waiter.priority:  # it would be the head
            routes = self._take(n, waiter.key, waiter.allowed, waiter.priority)
            if routes is not None:
                self.stats.waited(0.0)
                return routes
        if not self._alive():
            self.stats.reject(Rejection.NO_WORKER)
            raise _no_worker()
        if len(self._queue) >= self.config.max_queue and not self._displace(waiter.priority):
            self.stats.reject(Rejection.QUEUE_FULL)
            raise overloaded(f"The server is overloaded: {len(self._queue)} requests are already "
                             "waiting. Retry later.", self.config.retry_after_s)
        self._enqueue(waiter)
        try:
            await asyncio.wait({waiter.future}, timeout=self.config.queue_timeout_s)
        except asyncio.CancelledError:  # the client left while queued
            self._leave(waiter)
            raise
        if waiter.future.done():
            routes = waiter.future.result()  # or the 503 of `wake`: no worker left to wait for
            self.stats.waited(self.clock() - waiter.since)
            return routes
        self._leave(waiter)
        if not self.pool.ready:  # still none in rotation (a restart outlasted the queue's bound)
            self.stats.reject(Rejection.NO_WORKER)
            raise _no_worker()
        self.stats.reject(Rejection.QUEUE_TIMEOUT)
        logger.warning("request refused after %.1f s in the admission queue (%d waiting)",
                       self.clock() - waiter.since, len(self._queue))
        raise overloaded(f"The server is overloaded: no room for the request within "
                         f"{self.config.queue_timeout_s:g} s. Retry later.", self.config.retry_after_s)

    def _enqueue(self, waiter: _Waiter) -> None:
        """Behind every waiting request of its priority or a smaller one (all of them under fcfs)."""
        at = len(self._queue)
        while at > 0 and self._queue[at - 1].priority > waiter.priority:
            at -= 1
        self._queue.insert(at, waiter)

    def _displace(self, priority: int) -> bool:
        """The queue is full: refuse its last request if it waits with a larger priority than
        `priority` (its place goes to the newcomer); False when none does."""
        if not self._queue or self._queue[-1].priority <= priority:
            return False
        last = self._queue.pop()
        if not last.future.done():
            self.stats.reject(Rejection.QUEUE_FULL)
            last.future.set_exception(overloaded(
                "The server is overloaded: a request of a higher priority took this one's place in the "
                "queue. Retry later.", self.config.retry_after_s))
        return True

    def _leave(self, waiter: _Waiter) -> None:
        """Take `waiter` out of the queue; routes it was given meanwhile go back."""
        if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            for route in waiter.future.result():
                _reserve(route, -1)
        else:
            waiter.future.cancel()
        try:
            self._queue.remove(waiter)
        except ValueError:
            pass
        self.wake()

    def wake(self) -> None:
        """Admit queued requests, head first, while they fit; refuse them all (503) once no
        worker of a needed role is left to wait for."""
        if self._queue and not self._alive():
            logger.warning("no worker of a needed role is alive or being restarted: refusing the %d "
                           "queued request(s)", len(self._queue))
            while self._queue:
                waiter = self._queue.popleft()
                if not waiter.future.done():
                    self.stats.reject(Rejection.NO_WORKER)
                    waiter.future.set_exception(_no_worker())
            return
        while self._queue:
            head = self._queue[0]
            if head.future.done():
                self._queue.popleft()
                continue
            routes = self._take(head.n, head.key, head.allowed, head.priority)
            if routes is None:
                return
            self._queue.popleft()
            head.future.set_result(routes)


def _no_worker() -> APIError:
    return unavailable("No worker is available to serve the request; try again later.")


def _reserve(route: Route, delta: int) -> None:
    route.decode.reserved += delta
    if route.prefill is not None:
        route.prefill.reserved += delta
