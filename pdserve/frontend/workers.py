"""The workers the router knows, their health and load, and which ones a new request goes to.

A poller asks every worker for /health and /load every ``health_interval_s``. Busy is not dead
(docs/liveness.md):

* **Dead**: its port refuses connections, or it reports that it failed. It is taken out of
  rotation and every request in flight on it fails at once.
* **Slow**: no answer for ``slow_after_s`` (a saturated CPU, a long step, a paused process).
  It gets no new requests; those in flight on it go on. It is back as soon as it answers.
* **Silent past the bound**: no answer for ``dead_after_s`` (tens of seconds): counted dead.

A worker that reports itself wedged (no loop step for a while) or draining gets no new requests;
a wedged one's requests fail once it has been unwell for ``wedged_grace_s``.

The set of workers can change while serving (``sync``, from DNS discovery): a new worker joins
once it answers healthy; a worker that disappeared from its source retires (no new requests)
and leaves once nothing runs on it any more, so its in-flight requests finish.

A worker that died is probed on: when it answers again (a restarted process on the same URL,
a new worker id), it is back in rotation. Its supervisor (`pdserve serve`) says when a dead
worker is being restarted (``expect_back``); workers found by discovery are restarted by their
orchestrator (``orchestrated``). Either way requests that need a missing worker wait in the
admission queue for it, up to the queue's bound, instead of getting a 503 at once.

A worker proven dead, every rank of it (its supervisor saw them exit: ``peer_dead``; or a new
process of it answers at its URL), is announced to the workers of the other PD role
(``POST /peers/dead``), which fail and fence the rooms they shared with that process at once
(docs/supervision.md). A refused port alone is not such proof.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from pdserve.frontend.errors import APIError, unavailable
from pdserve.frontend.worker_client import Probe, WorkerClient
from pdserve.worker_api import Info, Load, PeerDead, Role

logger = logging.getLogger(__name__)
MAX_PENDING_PROBES = 4  # per worker: a worker that hangs holds at most this many probes open
RECHECK_TIMEOUT_S = 0.5  # a probe after a request failed on the worker: how long to wait for its answer


class InFlight(Protocol):
    """A request on a worker that can be failed from outside (a ChoiceRun)."""

    def fail(self, error: APIError) -> None: ...


class InFlightSet(set):
    """A worker's requests in flight. When one leaves, `on_leave` runs: a queued request may
    now fit (admission.py)."""

    on_leave: Callable[[], None] | None = None

    def discard(self, item: object) -> None:
        if item in self:
            super().discard(item)
            if self.on_leave is not None:
                self.on_leave()

    def clear(self) -> None:
        had = bool(self)
        super().clear()
        if had and self.on_leave is not None:
            self.on_leave()


@dataclass(eq=False)
class WorkerEndpoint:
    """One worker as the router sees it: its URL and role, what it last said, what runs there."""

    url: str
    role: Role
    healthy: bool = False
    draining: bool = False
    status: str = "unknown"
    info: Info | None = None    # its /info, read once it answers healthy
    load: Load = field(default_factory=Load)
    last_ok: float = 0.0        # when it last answered ok (or draining)
    last_answer: float = 0.0    # when it last answered anything
    last_pick: float = 0.0
    asked: list[float] = field(default_factory=list)  # when each probe still in flight was sent
    unanswered_since: float | None = None  # the oldest probe since the last answer that got none
    slow: bool = False          # silent for slow_after_s: no new requests, those in flight go on
    reserved: int = 0           # admitted requests not yet started here (admission.py)
    inflight: InFlightSet = field(default_factory=InFlightSet)
    source: str | None = None   # the discovery target (NAME:PORT) it came from; None: given as a URL
    retired: bool = False       # gone from its source: no new requests, removed once idle
    restarting: bool = False    # dead, and its supervisor is restarting it: requests may wait for it
    load_step: int | None = None  # its step counter when `load` was read (/load changes only in a step)
    known: Info | None = None   # the last /info read, kept after it died: which process a notice names
    down_at: float = float("-inf")  # when it was last found dead: answers to older questions are stale
    ok_asked_at: float = float("-inf")  # when the last question it answered "ok" was asked

    @property
    def incarnation(self) -> str | None:
        """Its process, from /info (a restarted worker with the same worker id has another)."""
        if self.info is None:
            return None
        return self.info.incarnation or None

    @property
    def worker_id(self) -> str | None:
        """From /info; decode workers need a prefill worker's id to watch the peer of a room."""
        return self.info.worker_id if self.info is not None and self.info.worker_id else None

    @property
    def in_rotation(self) -> bool:
        """Alive and not leaving: takes new requests now or once it answers again (slow)."""
        return (self.healthy and not self.draining and not self.retired
                and (self.role is not Role.PREFILL or bool(self.worker_id)))

    @property
    def available(self) -> bool:
        """Takes new requests now (a prefill worker only once its worker id is known)."""
        return self.in_rotation and not self.slow

    @property
    def max_num_seqs(self) -> int:
        """What it reported in /info (0: unknown)."""
        return self.info.max_num_seqs if self.info is not None else 0

    def score(self) -> int:
        """Requests queued or running here: the worker's last report, or the router's own count
        of requests it sent since then (and those admitted for it), whichever is larger."""
        return max(self.load.queued, len(self.inflight)) + self.reserved


class Route(NamedTuple):
    decode: WorkerEndpoint          # decode or colocated worker: it streams the tokens
    prefill: WorkerEndpoint | None  # None when `decode` is a colocated ("both") worker


class WorkerPool:
    def __init__(self, client: WorkerClient, prefill: list[str], decode: list[str], both: list[str],
                 *, interval_s: float = 0.5, idle_interval_s: float = 2.0, timeout_s: float = 5.0,
                 slow_after_s: float = 1.5,
                 dead_after_s: float = 30.0, wedged_grace_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_health: Callable[[WorkerEndpoint], None] | None = None) -> None:
        self.client = client
        self.workers = ([WorkerEndpoint(_norm(u), Role.PREFILL) for u in prefill]
                        + [WorkerEndpoint(_norm(u), Role.DECODE) for u in decode]
                        + [WorkerEndpoint(_norm(u), Role.BOTH) for u in both])
        self.interval_s = interval_s
        self.idle_interval_s = max(interval_s, idle_interval_s)
        self.timeout_s = timeout_s
        self.slow_after_s = min(slow_after_s, dead_after_s)
        self.dead_after_s = dead_after_s
        self.wedged_grace_s = wedged_grace_s
        self.clock = clock
        self.on_health = on_health
        self.on_change: Callable[[], None] | None = None  # room may have appeared (admission.py)
        # roles whose workers an orchestrator keeps running (found by discovery: a pod that
        # died is restarted by the kubelet): requests wait for them as for a restarting worker
        self.orchestrated: set[Role] = set()
        self._pollers: dict[WorkerEndpoint, asyncio.Task[None]] = {}
        self._notices: set[asyncio.Task[None]] = set()  # peer-dead notices being sent
        self._running = False
        for w in self.workers:
            w.inflight.on_leave = self._changed

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # ---- choosing ------------------------------------------------------------------------------

    def of_role(self, role: Role) -> list[WorkerEndpoint]:
        return [w for w in self.workers if w.role is role]

    @property
    def ready(self) -> bool:
        """At least one prefill and one decode worker, or one colocated worker, are in rotation
        (a slow one counts: requests wait for it in the admission queue)."""
        up = {w.role for w in self.workers if w.in_rotation}
        return Role.BOTH in up or {Role.PREFILL, Role.DECODE} <= up

    @property
    def recovering(self) -> bool:
        """Every needed role has a worker in rotation or being restarted: a request that needs
        the missing one may wait for it (admission.py) instead of failing at once."""
        up = {w.role for w in self.workers if w.in_rotation or (w.restarting and not w.retired)} | self.orchestrated
        return Role.BOTH in up or {Role.PREFILL, Role.DECODE} <= up

    def expect_back(self, url: str, coming_back: bool) -> None:
        """Its supervisor saw the worker at `url` exit, and is (or is not) restarting it. The
        process is gone: out of rotation now, without waiting for the next probe."""
        for w in self.workers:
            if w.url != _norm(url):
                continue
            if w.restarting != coming_back:
                w.restarting = coming_back
                logger.info("worker %s (%s) exited; %s", w.url, w.role.value,
                            "it is being restarted" if coming_back else "it will not be restarted")
            if w.healthy or w.inflight:
                self.observe(w, Probe(False, "refused"))
        self._changed()

    def peer_dead(self, url: str, reason: str) -> asyncio.Task[None] | None:
        """The worker at `url` is dead, every rank of it (its supervisor saw them all exit): tell
        each worker that shares rooms with it (the other PD role), so that they fail and fence
        those rooms now instead of after their lease. The notice names the process that died
        (its worker id and incarnation, from its last /info): a late one never touches the rooms
        of a restarted worker. None when nothing is known of it (it never answered /info)."""
        dead = next((w for w in self.workers if w.url == _norm(url)), None)
        if dead is None or dead.known is None:
            return None
        return self._tell_peers(dead, dead.known, reason)

    def _tell_peers(self, dead: WorkerEndpoint, info: Info, reason: str) -> asyncio.Task[None] | None:
        if dead.role is Role.BOTH:  # a colocated worker shares no rooms
            return None
        peers = [w for w in self.workers if w.role is (Role.DECODE if dead.role is Role.PREFILL else Role.PREFILL)]
        body = PeerDead(worker_id=info.worker_id, incarnation=info.incarnation or None, reason=reason)
        logger.info("telling %d %s worker(s) that %s worker %s (%s) is dead", len(peers),
                    "decode" if dead.role is Role.PREFILL else "prefill", dead.role.value, body.worker_id, dead.url)

        async def tell() -> None:
            done = await asyncio.gather(*(self.client.peer_dead(w.url, body, self.timeout_s) for w in peers))
            rooms = sum(n or 0 for n in done)
            if rooms:
                logger.info("the peers of dead worker %s settled %d room(s) shared with it", body.worker_id, rooms)
        task = asyncio.ensure_future(tell())
        self._notices.add(task)  # kept until sent (the loop holds tasks only weakly)
        task.add_done_callback(self._notices.discard)
        return task

    def pick(self, fits: Callable[[WorkerEndpoint], bool] | None = None,
             choose: Callable[[list[WorkerEndpoint]], WorkerEndpoint | None] | None = None,
             local: Callable[[WorkerEndpoint], bool] | None = None) -> Route:
        """A decode-capable worker, and for a decode worker a prefill one; only workers for which
        `fits` holds (admission: those with room). `choose` picks one of the candidates of a
        role (routing.py: by cached prefix and load); by default the least loaded. A decode
        worker for which `local` holds computes the prompt itself: no prefill worker."""
        def ok(w: WorkerEndpoint) -> bool:
            return w.available and (fits is None or fits(w))

        choose = choose or least_loaded
        prefill = choose([w for w in self.of_role(Role.PREFILL) if ok(w)])
        candidates = [w for w in self.workers if ok(w) and
                      (w.role is Role.BOTH or (w.role is Role.DECODE and prefill is not None))]
        decode = choose(candidates)
        if decode is None:
            raise unavailable("No worker is available to serve the request; try again later.")
        now = self.clock()
        decode.last_pick = now
        if decode.role is Role.BOTH or prefill is None or (local is not None and local(decode)):
            return Route(decode, None)  # (a decode worker is a candidate only beside a prefill one)
        prefill.last_pick = now
        return Route(decode, prefill)

    @property
    def max_model_len(self) -> int | None:
        lens = [w.info.max_model_len for w in self.workers if w.info is not None]
        return min(lens) if lens else None

    # ---- health --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Probe every worker every `interval_s`, and watch for silence, forever (cancel to stop).

        Probes do not wait for each other: a slow answer does not delay the next question, and a
        worker counts as slow when no answer at all came for `slow_after_s` (dead after
        `dead_after_s`), however long one probe's timeout is.
        """
        self._running = True
        try:
            for w in self.workers:
                self._start_polling(w)
            await self._watch()
        finally:
            self._running = False
            for task in self._pollers.values():
                task.cancel()
            self._pollers.clear()

    def _start_polling(self, w: WorkerEndpoint) -> None:
        self._pollers[w] = asyncio.create_task(self._poll(w), name=f"poll-{w.url}")

    async def _poll(self, w: WorkerEndpoint) -> None:
        pending: set[asyncio.Task[None]] = set()
        try:
            while True:
                if len(pending) < MAX_PENDING_PROBES:
                    task = asyncio.create_task(self._probe_safely(w))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                # An idle worker in rotation is asked less often: an idle server costs nothing.
                busy = w.inflight or w.reserved or not w.available
                await asyncio.sleep(self.interval_s if busy else self.idle_interval_s)
        finally:
            for task in pending:
                task.cancel()

    async def _watch(self) -> None:
        busy_tick, idle_tick = self.interval_s / 4, self.idle_interval_s / 2
        tick = busy_tick
        last = self.clock()
        while True:
            await asyncio.sleep(tick)
            now = self.clock()
            late, last = now - last - tick, now
            # nothing in flight and every worker well: look as often as idle workers are probed
            tick = busy_tick if any(w.inflight or w.reserved or not w.available for w in self.workers) else idle_tick
            if late > 0.25:  # our own loop stalled: answers may be waiting unread; look next time
                continue
            for w in list(self.workers):
                if (w.healthy or w.inflight) and self.silence(w, now) >= self.slow_after_s:
                    self.observe(w, Probe(False, "unreachable"))
            self._drop_retired()
            self._changed()  # a queued request waits for time as well as for room

    async def _probe_safely(self, w: WorkerEndpoint, timeout_s: float | None = None) -> None:
        try:
            await self.probe(w, timeout_s)
        except Exception:  # a probe must never end the poller
            logger.exception("probing worker %s failed", w.url)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in list(self.workers)))

    async def recheck(self, workers: Iterable[WorkerEndpoint]) -> None:
        """Probe `workers` now, those not already out of rotation: a request just failed on them.
        A live worker answers in ms and a dead one refuses at once; one that hangs is not waited
        for (RECHECK_TIMEOUT_S)."""
        timeout_s = min(self.timeout_s, RECHECK_TIMEOUT_S)
        await asyncio.gather(*(self._probe_safely(w, timeout_s) for w in workers if w.healthy))

    # ---- membership ----------------------------------------------------------------------------

    def sync(self, source: str, role: Role, urls: Iterable[str]) -> list[WorkerEndpoint]:
        """The workers found at `source` are now `urls`. New ones join (polled at once; picked
        after their first good probe); missing ones retire. Returns the new workers."""
        wanted = {_norm(u) for u in urls}
        known = {w.url: w for w in self.workers if w.source == source}
        added = [WorkerEndpoint(url, role, source=source) for url in sorted(wanted - known.keys())]
        for w in added:
            logger.info("discovered %s worker %s (from %s)", role.value, w.url, source)
            w.inflight.on_leave = self._changed
            self.workers.append(w)
            if self._running:
                self._start_polling(w)
        for url, w in known.items():
            gone = url not in wanted
            if gone != w.retired:
                w.retired = gone
                logger.info("%s worker %s %s %s", role.value, url, "left" if gone else "is back in", source)
        self._drop_retired()
        return added

    def _drop_retired(self) -> None:
        for w in [w for w in self.workers if w.retired and not w.inflight]:
            self.workers.remove(w)
            task = self._pollers.pop(w, None)
            if task is not None:
                task.cancel()

    def silence(self, w: WorkerEndpoint, now: float) -> float:
        """How long `w` has left a question unanswered: since its oldest question still open (in
        flight, or timed out since its last answer), or since its last answer if that came later.
        0 while nothing is asked: the time it takes to answer, not how often it is asked (an idle
        worker is asked every `idle_interval_s`, which may exceed `slow_after_s`)."""
        open_since = [*w.asked, *([] if w.unanswered_since is None else [w.unanswered_since])]
        return now - max(w.last_answer, min(open_since)) if open_since else 0.0

    async def probe(self, w: WorkerEndpoint, timeout_s: float | None = None) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        asked_at = self.clock()
        w.asked.append(asked_at)
        try:
            probe, answered_at = await self._ask(w, timeout_s)
        finally:
            w.asked.remove(asked_at)
        self.observe(w, probe, answered_at, asked_at)
        self._changed()

    async def _ask(self, w: WorkerEndpoint, timeout_s: float) -> tuple[Probe, float]:
        """/health, then /info and /load as needed; the answer and when /health gave it."""
        probe = await self.client.health(w.url, timeout_s)
        answered_at = self.clock()
        if probe.ok and w.info is None:
            w.info = await self.client.info(w.url, timeout_s)
            if w.info is not None:
                before, w.known = w.known, w.info
                if before is not None and before.incarnation and before.incarnation != w.info.incarnation:
                    # a new process serves its URL once the old one, every rank of it, is gone
                    # (a restarted container, or a TP group that restarts whole): proof enough
                    self._tell_peers(w, before, "a new process of it answers at its URL")
            w.load_step = None  # maybe a new process: its step counter started over
            self._check_role(w)
        # what /load reports changes only in a step: with nothing of ours on it (no lease to
        # renew), a worker whose step counter did not move is not asked again (idle CPU)
        fresh = not (w.inflight or w.reserved) and probe.step is not None and probe.step == w.load_step
        if probe.answered and not fresh:  # draining or wedged too: /load also renews its lease on our requests
            load = await self.client.load(w.url, timeout_s)
            if load is not None:
                w.load, w.load_step = load, probe.step
        return probe, answered_at

    def observe(self, w: WorkerEndpoint, probe: Probe, answered_at: float | None = None,
                asked_at: float | None = None) -> None:
        """Apply one probe result to a worker (pure state change; no I/O): the answer to a question
        asked at `asked_at`, or (no `asked_at`) a look at the questions in flight. A good answer to a
        question asked before the worker was found dead is ignored: the process that gave it is
        gone (its probe's /load call outlived it), and it must not put the worker back."""
        now = self.clock()
        if probe.ok and asked_at is not None and asked_at < w.down_at:
            return
        at = now if answered_at is None else answered_at
        was = (w.healthy, w.draining, w.slow)
        w.status = probe.status
        what = f"worker {w.url} ({w.role.value}) is {probe.status}"
        if probe.answered:
            w.last_answer = max(w.last_answer, at)
            if w.unanswered_since is not None and w.unanswered_since <= w.last_answer:
                w.unanswered_since = None
        elif asked_at is not None and asked_at >= w.last_answer:
            # a question it never answered: the silence counts from it until an answer comes
            w.unanswered_since = asked_at if w.unanswered_since is None else min(w.unanswered_since, asked_at)
        silence = self.silence(w, now)
        if probe.ok or (probe.answered and probe.status == "draining"):
            w.healthy, w.draining, w.last_ok = True, probe.status == "draining", max(w.last_ok, at)
            if probe.ok:
                w.ok_asked_at = max(w.ok_asked_at, now if asked_at is None else asked_at)
            w.slow = w.restarting = False
        elif probe.answered and probe.status == "wedged":
            # Its loop made no step for a while: no new requests. A long step under load looks
            # the same at first, so its requests get `wedged_grace_s` more before they fail.
            w.healthy = w.draining = w.slow = False
            if now - w.last_ok >= self.wedged_grace_s:
                self.fail_inflight(w, what)
        elif probe.answered or probe.status == "refused":
            # It says it failed, or its port is closed (the process is gone): dead now.
            w.healthy = w.draining = w.slow = False
            w.down_at = now
            self.fail_inflight(w, what)
        elif silence >= self.dead_after_s:
            # Silence past the bound: a process that answers nothing for this long is dead to us.
            w.healthy = w.draining = w.slow = False
            w.down_at = now
            self.fail_inflight(w, f"worker {w.url} ({w.role.value}) did not answer for {silence:.0f} s "
                                  f"(the bound is {self.dead_after_s:g} s)")
        elif silence >= self.slow_after_s and w.healthy:
            w.slow = True  # busy or paused: keep what runs there, send nothing new for now
        if not w.healthy:
            w.info = None  # read again when it is back: it may be a new process
        if (w.healthy, w.draining, w.slow) != was:
            state = ("draining" if w.draining else "slow (no new requests)" if w.slow
                     else "healthy" if w.healthy else "out of rotation")
            log = logger.info if w.healthy else logger.warning
            log("worker %s (%s) is now %s (status %s, last answer %.1f s ago)", w.url, w.role.value,
                state, probe.status, now - w.last_ok)
            if self.on_health is not None:
                self.on_health(w)
            self._changed()

    def fail_inflight(self, w: WorkerEndpoint, reason: str) -> None:
        """Every request in flight on `w` fails now with 503."""
        victims = list(w.inflight)
        w.inflight.clear()
        if victims:
            logger.warning("%s: failing %d request(s) in flight on it", reason, len(victims))
        for run in victims:
            run.fail(unavailable(f"{reason}; the request was stopped."))

    def _check_role(self, w: WorkerEndpoint) -> None:
        if w.info is not None and w.info.role is not w.role:
            logger.warning("worker %s reports role %r but was given as %s", w.url, w.info.role.value, w.role.value)


def least_loaded(workers: list[WorkerEndpoint]) -> WorkerEndpoint | None:
    """Fewest requests queued or running; ties: the one picked longest ago."""
    return min(workers, key=lambda w: (w.score(), w.last_pick), default=None)


def _norm(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"
