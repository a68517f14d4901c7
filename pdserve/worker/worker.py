"""A worker: rank 0's runtime (runtime.py) on its own thread, bridged to the asyncio HTTP server.

The loop thread is the only thread that touches the engine and the transfer agent. HTTP
handlers talk to it through the engine's thread-safe inbox, and get their outputs back through
per-request asyncio queues fed with `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace

from pdserve.distributed.layout import LOOPBACK, TPLayout, parse_addr
from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import FinishReason, KVRole
from pdserve.logs import about
from pdserve.metrics import WorkerMetrics
from pdserve.scheduler.plan import KVPeer, StepOutput, StepPlan

from .accounting import Accounting
from .faults import FaultPlan, Wedge
from .ranks import dead_ranks, free_port, spawn_ranks
from .runtime import RankRuntime

logger = logging.getLogger(__name__)

# Nothing to compute until something arrives, but a request is open (a room waits for its KV,
# a prefill's KV is being written): poll the transfers soon. Stepping at once instead spun a core
# (~2.5 ms of Python a step), and on a shared machine the PD prefill's forward lost its second
# thread to the decode worker's spin (docs/liveness.md).
IDLE_WAIT_S = 0.005
# Nothing open at all: sleep until the inbox wakes the loop, but step at least this often, so the
# TP group's collectives stay far inside their timeout and /health's step stays fresh
# (docs/liveness.md: an idle worker costs nothing).
IDLE_TICK_S = 5.0
# A step failed and no rank process has exited yet: how long one that is exiting may take to be
# seen (only on the way out; a failure with every rank alive is reported after it).
DYING_RANK_S = 1.0


@dataclass
class WorkerSettings:
    role: str                        # "prefill" | "decode" | "both"
    worker_id: str = ""
    health_stall_timeout: float = 10.0  # /health fails when the loop made no step for this long
    drain_timeout: float = 30.0
    tp: int = 1                         # ranks of the whole TP group, on all its nodes
    check_divergence: int = 0           # compare the ranks' state digests every K steps (0: off)
    collective_timeout: float = 60.0
    nnodes: int = 1                     # machines (pods) the TP group spans
    node_rank: int = 0                  # this machine's index; 0 holds rank 0 and the API
    dist_init_addr: str | None = None   # HOST:PORT of rank 0's rendezvous (None: a loopback port)
    dist_init_timeout: float | None = None  # how long ranks wait for each other (None: collective_timeout)
    log_json: bool = False
    rank_log_level: str = "WARNING"     # child ranks repeat rank 0's INFO lines: they log less

    def __post_init__(self) -> None:
        KVRole.of_worker(self.role)  # ValueError for an unknown role
        TPLayout(self.tp, self.nnodes, self.node_rank)  # ValueError when they do not fit together
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (where node 0 "
                             "listens for the other nodes' ranks)")
        if self.dist_init_addr:
            parse_addr(self.dist_init_addr)
        if not self.worker_id:
            self.worker_id = f"{socket.gethostname()}-{self.role}-{int(time.time() * 1000) % 10**8}"

    @property
    def layout(self) -> TPLayout:
        return TPLayout(self.tp, self.nnodes, self.node_rank)

    @property
    def rendezvous(self) -> tuple[str, int]:
        """(host, port) every rank of the group meets at; set by `with_rendezvous`."""
        if not self.dist_init_addr:
            raise ValueError("no rendezvous address: call with_rendezvous() first")
        return parse_addr(self.dist_init_addr)

    def with_rendezvous(self) -> WorkerSettings:
        """These settings with a rendezvous address: --dist-init-addr, else a free loopback port
        (every rank is a child of this process)."""
        return self if self.dist_init_addr else replace(self, dist_init_addr=f"{LOOPBACK}:{free_port()}")


class Worker:
    """Rank 0 of a worker: its rank runtime on the loop thread, and the map from request ids to
    their output queues. Metrics and abort counting are `Accounting`'s; faults a test's plan's."""

    def __init__(self, engine_config: EngineConfig, settings: WorkerSettings, on_fatal=None,
                 model_name: str = "default", faults: FaultPlan | None = None):
        if not settings.layout.leader:
            raise ValueError("a worker runs on node 0; other nodes run follower.run_follower")
        self.on_fatal = on_fatal or (lambda: None)
        self.faults = faults
        self._wedge = Wedge() if faults is not None and faults.debug_routes else None
        self.ranks = []
        if settings.tp > 1:  # this process is rank 0; this node's other ranks are its children
            settings = settings.with_rendezvous()
            self.ranks = spawn_ranks(settings.layout.children, engine_config, settings)
        self.settings = settings
        self.runtime = RankRuntime(0, engine_config, settings, faults)
        self.engine = self.runtime.engine
        pool = self.engine.pool
        self.accounting = Accounting(settings.role, model_name,
                                     pool.bytes_per_block(pool.layer_specs, pool.block_size) * settings.tp,
                                     pool.block_size)
        self.engine.grammars.observer = self.metrics
        self.engine.loop.emit = self._emit  # outputs go out before the step's forward runs
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.last_step = time.monotonic()
        self.step_count = 0
        self.draining = False
        self.error: str | None = None
        self._snapshot_at = 0.0
        # well inside the stall bound of /health and the collectives' timeout
        self._idle_tick = min(IDLE_TICK_S, settings.health_stall_timeout / 3, settings.collective_timeout / 4)
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    @property
    def metrics(self) -> WorkerMetrics:
        return self.accounting.metrics

    @property
    def bootstrap(self) -> list[str] | None:
        return self.runtime.bootstrap

    # ---- the loop thread -----------------------------------------------------------------

    def start(self) -> None:
        ready = threading.Event()
        self._ready = ready
        self._thread.start()
        ready.wait()
        if self.error:
            raise RuntimeError(self.error)

    def _run(self) -> None:
        try:
            self.runtime.connect()  # on this thread: the agent's one thread
        except Exception as e:  # noqa: BLE001 - reported to start()
            self.error = f"cannot start the transfer agent: {e}"
            self._ready.set()
            return
        self._ready.set()
        try:
            self.runtime.run(self)
        except Exception as e:  # a failed step or a dead rank: fail every request, stop the worker
            logger.exception("the scheduler loop failed; the worker stops")
            # A rank that died usually shows first as a collective's transport error: the clients
            # are told the cause, the log keeps the transport's own message.
            dead = dead_ranks(self.ranks, wait=DYING_RANK_S)
            self.error = f"TP rank process {dead[0]} died" if dead else f"the scheduler loop failed: {e}"
            self._fail_all(self.error, worker_died=bool(dead))
            self.on_fatal()
        finally:
            self.runtime.close()

    def before_step(self) -> bool:
        """StepHooks: a dead rank stops the loop; True once stop() was called."""
        dead = dead_ranks(self.ranks)
        if dead:
            raise RuntimeError(f"TP rank process {dead[0]} died")
        if self._wedge is not None:
            self._wedge.stall()
        return self._stop.is_set()

    def after_step(self, plan: StepPlan, outputs: list[StepOutput]) -> None:
        """StepHooks: count, nap when idle (the outputs went out in the step: `_emit`)."""
        now = time.monotonic()
        if now - self._snapshot_at > 0.1:
            self._snapshot(now)
        self.last_step = now
        self.step_count += 1
        loop = self.engine.loop
        self.accounting.step(loop.step_s, loop.agree_s)
        if plan.follow_up_wait:
            self._await_follow_up(plan.follow_up_wait)
            return
        busy = self.engine.has_work()
        if not busy or self.engine.waits(plan):
            quiet = not busy and not self._queues  # no HTTP call open: no transfer can be under way either
            if quiet:
                self._snapshot(now)  # /load and /metrics show the last step's state while it sleeps
            self._wake.wait(self._idle_tick if quiet else IDLE_WAIT_S)
            self._wake.clear()

    def _await_follow_up(self, wait_s: float) -> None:
        """The plan held its decodes back for a finished request's next turn: wait until the
        inbox wakes the loop (a request, an abort) or `wait_s` passes (scheduler/follow_ups.py)."""
        self._wake.clear()  # then look: a request queued before the clear is seen, one after it wakes us
        t0 = time.monotonic()
        woken = not self.engine.inbox_empty() or self._wake.wait(wait_s)
        self.accounting.metrics.follow_up_waited(time.monotonic() - t0, woken)

    def _snapshot(self, now: float) -> None:
        self._snapshot_at = now
        self.accounting.load(self.engine.scheduler)
        if self.runtime.agent is not None:
            self.accounting.agent(self.runtime.agent.metrics())

    def _emit(self, outputs: list[StepOutput]) -> None:
        """The loop's `emit`, on the loop thread: count the outputs and hand them out."""
        self.accounting.outputs(outputs, time.monotonic())
        self._dispatch(outputs)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        with self._lock:
            for out in outputs:
                entry = self._queues.get(out.request_id)
                if entry is not None:
                    loop, q = entry
                    loop.call_soon_threadsafe(q.put_nowait, out)

    def _fail_all(self, error: str, worker_died: bool = False) -> None:
        """Every request ends with `error`; `worker_died`: a rank process died (no request's
        fault, so the router may run them again elsewhere), not a failed step."""
        self._dispatch([StepOutput(rid, finish_reason=FinishReason.ERROR, error=error, worker_died=worker_died)
                        for rid in list(self._queues)])

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        for p in self.ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    # ---- called from asyncio handlers ----------------------------------------------------

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               peer: KVPeer | dict | None = None) -> asyncio.Queue:
        """Queue a request; its outputs arrive on the returned queue (the last has finish_reason).
        `peer`: a `KVPeer`, or the dict the API builds ({"worker_id"} or {"bootstrap", "blocks",
        "cached_blocks"})."""
        if isinstance(peer, dict):
            peer = KVPeer(peer.get("worker_id", ""), tuple(peer.get("bootstrap", ())),
                          tuple(peer.get("blocks", ())), int(peer.get("cached_blocks", 0)))
        self.engine.check(prompt_ids, params)  # before anything is booked for it
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._queues[request_id] = (asyncio.get_running_loop(), q)
        self.accounting.started(request_id, len(prompt_ids), peer.cached_blocks if peer is not None else 0)
        logger.debug("request %s: %d prompt tokens", request_id, len(prompt_ids), extra=about(request_id))
        self.engine.add_request(request_id, prompt_ids, params, peer)
        self._wake.set()
        return q

    def release(self, request_id: str) -> None:
        """The handler is done with a request's queue."""
        with self._lock:
            self._queues.pop(request_id, None)

    def abort(self, request_id: str, reason: str = "abort", origin: str = "router") -> bool:
        """Abort a request for `origin` (idempotent). True when it was running here and this
        call counted its abort (aborts.py)."""
        counted = self.accounting.aborts.told(request_id, origin)
        if counted:
            logger.info("request %s: aborted (origin: %s)", request_id, origin, extra=about(request_id))
        self.engine.abort(request_id, FinishReason(reason))
        self._wake.set()
        return counted

    def peer_dead(self, rooms: list[str], reason: str) -> None:
        """The peer worker of these rooms died: they fail and are fenced on every rank, in the
        next step (their blocks come back; a request still waiting for its KV ends with an error)."""
        self.engine.peer_dead(rooms, reason)
        self._wake.set()

    def reset_prefix_cache(self) -> Future:
        """Forget the prefix cache in the next step, on every rank; the future's result, once
        that step is applied, is the number of cached device blocks forgotten."""
        done = self.engine.reset_prefix_cache()
        self._wake.set()
        return done

    def reader_left(self, request_id: str) -> None:
        """The request's HTTP stream closed before its finish: abort it now; who asked is
        counted when the router's /abort says (aborts.py)."""
        if self.accounting.aborts.reader_left(request_id):
            logger.info("request %s: its stream closed before the finish; aborting", request_id,
                        extra=about(request_id))
        self.engine.abort(request_id, FinishReason.ABORT)
        self._wake.set()

    def in_flight(self) -> int:
        return len(self._queues)

    def in_flight_ids(self) -> list[str]:
        with self._lock:
            return list(self._queues)

    def wedge(self, seconds: float) -> None:
        """Test fault (the plan's debug_routes): the loop stalls for `seconds` inside a step."""
        if self._wedge is None:
            raise RuntimeError("no fault plan with debug_routes: this worker cannot be wedged")
        self._wedge.arm(seconds)
        self._wake.set()  # an idle loop stalls at its next step, now

    def seconds_since_step(self) -> float:
        return time.monotonic() - self.last_step

    def healthy(self) -> bool:
        return (self.error is None and self._thread.is_alive()
                and self.seconds_since_step() < self.settings.health_stall_timeout)

    def load(self) -> dict:
        s = self.engine.scheduler
        running, waiting = s.load()
        return {"waiting": waiting, "running": running, "transferring": len(s.held),
                "free_blocks": s.allocator.num_free, "total_blocks": s.allocator.num_blocks,
                "in_flight": len(self._queues),
                "rooms_live": self.accounting.transfer.get("rooms_live", 0),
                "step_seconds": self.engine.loop.times.as_dict()}
