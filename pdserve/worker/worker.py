"""A worker: the engine's loop on its own thread, bridged to the asyncio HTTP server.

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
from dataclasses import dataclass, replace

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.distributed.groups import init_tp
from pdserve.distributed.layout import LOOPBACK, TPLayout, parse_addr
from pdserve.logs import about
from pdserve.metrics import WorkerMetrics
from pdserve.scheduler.plan import StepOutput

from .aborts import AbortLedger
from .hooks import TestHooks
from .ranks import free_port, group_worker_id, make_agent, share_bootstrap, spawn_ranks

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005  # the loop's nap when idle: short, since it must keep polling transfers


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
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"unknown worker role {self.role!r}")
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


@dataclass
class _RequestStats:
    arrival: float
    prompt_tokens: int
    generated: int = 0
    write_at: float | None = None  # prefill: when its KV write started


class Worker:
    """Owns the engine, its loop thread and the map from request ids to their output queues."""

    def __init__(self, engine_config: EngineConfig, settings: WorkerSettings, on_fatal=None,
                 model_name: str = "default"):
        if not settings.layout.leader:
            raise ValueError("a worker runs on node 0; other nodes run follower.run_follower")
        self.settings = settings
        self.metrics = WorkerMetrics(settings.role, model_name)
        self.aborts = AbortLedger(self.metrics.aborted)
        self._stats: dict[str, _RequestStats] = {}
        self._agent_counts: dict[str, int] = {}
        self.on_fatal = on_fatal or (lambda: None)
        kv = {"both": "local", "prefill": "prefill", "decode": "decode"}[settings.role]
        tp = comm = None
        self.ranks = []
        if settings.tp > 1:  # this process is rank 0; this node's other ranks are its children
            self.settings = settings = settings.with_rendezvous()
            engine_config = replace(engine_config, device=settings.layout.device(engine_config.device, 0))
            self.ranks = spawn_ranks(settings.layout.children, engine_config, settings)
            host, port = settings.rendezvous
            tp, comm = init_tp(0, settings.tp, port, engine_config.device, settings.collective_timeout,
                               host=host, init_timeout_s=settings.dist_init_timeout)
        self.engine = LLMEngine(engine_config, kv, tp, comm, digest_every=settings.check_divergence)
        self.agent = None  # made on the loop thread: a NIXL agent is used by one thread only
        self.bootstrap: list[str] | None = None
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.last_step = time.monotonic()
        self.step_count = 0
        self.draining = False
        self.error: str | None = None
        self.transfer_metrics: dict[str, int] = {}  # snapshot taken on the loop thread
        self._snapshot_at = 0.0
        self._wedge_for = 0.0
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

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
            worker_id = group_worker_id(self.engine.comm, self.settings.worker_id)
            self.agent = make_agent(self.settings.role, worker_id, 0, self.engine)
            self.bootstrap = share_bootstrap(self.engine.comm, self.agent)
            TestHooks.from_env(0).install(self.engine)
        except Exception as e:  # noqa: BLE001 - reported to start()
            self.error = f"cannot start the transfer agent: {e}"
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except Exception as e:  # a failed step or a dead rank: fail every request, stop the worker
            logger.exception("the scheduler loop failed; the worker stops")
            self.error = f"the scheduler loop failed: {e}"
            self._fail_all(self.error)
            self.on_fatal()
        finally:
            if self.agent is not None:
                self.agent.close()

    def _loop(self) -> None:
        while True:
            dead = [p.name for p in self.ranks if not p.is_alive()]
            if dead:
                raise RuntimeError(f"TP rank process {dead[0]} died")
            stopping = self._stop.is_set()
            if self._wedge_for:
                time.sleep(self._wedge_for)
                self._wedge_for = 0.0
            plan, outputs = self.engine.step(shutdown=stopping)
            if plan.error:
                raise RuntimeError(plan.error)
            if stopping:
                return
            now = time.monotonic()
            if now - self._snapshot_at > 0.1:
                self._snapshot(now)
            self.last_step = now
            self.step_count += 1
            self.metrics.scheduler_step(self.engine.loop.step_s, self.engine.loop.agree_s)
            self.aborts.sweep()
            if outputs:
                self._count(outputs, now)
                self._dispatch(outputs)
            if not self.engine.has_work():
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()

    def _snapshot(self, now: float) -> None:
        """Refresh gauges, and turn the agent's cumulative counters into metric increments."""
        self._snapshot_at = now
        a = self.engine.allocator
        s = self.engine.scheduler
        self.metrics.set_load(running=len(s.running), waiting=len(s.waiting) + len(s.held),
                              used_blocks=a.num_used, total_blocks=a.num_blocks)
        if self.agent is None:
            return
        self.transfer_metrics = counts = self.agent.metrics()
        counts = dict(counts, late=sum(v for k, v in counts.items() if k.startswith(("late_", "unknown_"))))
        for state in ("done", "failed", "aborted"):
            for _ in range(self._delta(counts, f"rooms_{state}")):
                self.metrics.room_ended(state)
        self.metrics.late_messages_dropped.inc(self._delta(counts, "late"))

    def _delta(self, counts: dict[str, int], key: str) -> int:
        """How much a cumulative agent counter grew since the last snapshot."""
        n = counts.get(key, 0) - self._agent_counts.get(key, 0)
        self._agent_counts[key] = counts.get(key, 0)
        return max(n, 0)

    def _count(self, outputs: list[StepOutput], now: float) -> None:
        pool = self.engine.pool
        bytes_per_block = pool.bytes_per_block(pool.layer_specs, pool.block_size)
        for out in outputs:
            st = self._stats.get(out.request_id)
            if st is None:
                continue
            if out.token_id is not None:
                st.generated += 1
                if out.finish_reason == "prefilled":  # prefill: the KV write starts now
                    st.write_at = now
            elif out.finish_reason == "prefilled" and st.write_at is not None:  # written
                blocks = -(-st.prompt_tokens // self.engine.pool.block_size)
                self.metrics.kv_transferred(now - st.write_at, blocks * bytes_per_block * self.settings.tp)
            if out.finish_reason and (out.token_id is None or out.finish_reason != "prefilled"):
                with self._lock:
                    del self._stats[out.request_id]
                self.aborts.finished(out.request_id)
                if out.finish_reason == "error":
                    logger.warning("request %s failed: %s", out.request_id, out.error,
                                   extra=about(out.request_id))
                else:
                    logger.debug("request %s finished (%s) after %d tokens", out.request_id,
                                 out.finish_reason, st.generated, extra=about(out.request_id))
                reason = "abort" if out.finish_reason == "abort" else out.finish_reason
                self.metrics.request_finished("length" if reason == "prefilled" else reason,
                                              prompt_tokens=st.prompt_tokens, generation_tokens=st.generated,
                                              decode_s=now - st.arrival)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        with self._lock:
            for out in outputs:
                entry = self._queues.get(out.request_id)
                if entry is not None:
                    loop, q = entry
                    loop.call_soon_threadsafe(q.put_nowait, out)

    def _fail_all(self, error: str) -> None:
        self._dispatch([StepOutput(rid, finish_reason="error", error=error) for rid in list(self._queues)])

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
               peer: dict | None = None) -> asyncio.Queue:
        """Queue a request; its outputs arrive on the returned queue (the last has finish_reason)."""
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._queues[request_id] = (asyncio.get_running_loop(), q)
            self._stats[request_id] = _RequestStats(time.monotonic(), len(prompt_ids))
        self.aborts.started(request_id)
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
        counted = self.aborts.told(request_id, origin)
        if counted:
            logger.info("request %s: aborted (origin: %s)", request_id, origin, extra=about(request_id))
        self.engine.abort(request_id, reason)
        self._wake.set()
        return counted

    def reader_left(self, request_id: str) -> None:
        """The request's HTTP stream closed before its finish: abort it now; who asked is
        counted when the router's /abort says (aborts.py)."""
        if self.aborts.reader_left(request_id):
            logger.info("request %s: its stream closed before the finish; aborting", request_id,
                        extra=about(request_id))
        self.engine.abort(request_id, "abort")
        self._wake.set()

    def in_flight(self) -> int:
        return len(self._queues)

    def in_flight_ids(self) -> list[str]:
        with self._lock:
            return list(self._queues)

    def wedge(self, seconds: float) -> None:
        """Test hook: the loop stalls for `seconds` inside a step (as a stuck forward would)."""
        self._wedge_for = seconds

    def seconds_since_step(self) -> float:
        return time.monotonic() - self.last_step

    def healthy(self) -> bool:
        return (self.error is None and self._thread.is_alive()
                and self.seconds_since_step() < self.settings.health_stall_timeout)

    def load(self) -> dict:
        s = self.engine.scheduler
        return {"waiting": len(s.waiting), "running": len(s.running), "transferring": len(s.held),
                "free_blocks": s.allocator.num_free, "total_blocks": s.allocator.num_blocks,
                "in_flight": len(self._queues), "rooms_live": self.transfer_metrics.get("rooms_live", 0)}
