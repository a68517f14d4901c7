"""`pdserve prefill | decode | worker`: start a worker and serve its internal API; on nodes
1..K-1 of a multi-node TP group, run that node's ranks (follower.py)."""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
import time

import uvicorn

from pdserve.engine.config import ContextDoesNotFit
from pdserve.logs import about, setup_logging
from pdserve.model_name import served_name
from pdserve.preflight import ConfigError, Settings, bind_port, check
from pdserve.quiet_server import QuietServer

from .faults import FaultPlan
from .ranks import leave
from .server import build_app
from .worker import Worker, WorkerSettings

logger = logging.getLogger(__name__)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address of the internal API")
    p.add_argument("--port", type=int, default=8100, help="port of the internal API")
    p.add_argument("--worker-id", default="", help="stable id of this worker (default: host-role-time)")
    p.add_argument("--health-stall-timeout", type=float, default=10.0,
                   help="/health answers 503 when the scheduler loop made no step for this many seconds")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests may finish before they are aborted")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks of this worker (processes), on all its nodes together")
    m = p.add_argument_group("multi-node TP (one TP group over several machines or pods)")
    m.add_argument("--nnodes", type=int, default=1, metavar="K",
                   help="machines the TP group spans; each runs --tp/K ranks (default 1: this one)")
    m.add_argument("--node-rank", type=int, default=0, metavar="R",
                   help="this machine's index, 0 .. K-1. Node 0 holds rank 0 and serves the worker API; "
                        "the others serve only /health and /ready, and follow node 0")
    m.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="where node 0's rank 0 listens for the group's rendezvous (every interface, at "
                        "PORT); needed with --nnodes > 1 (default: a free loopback port)")
    m.add_argument("--dist-init-timeout", type=float, default=None, metavar="S",
                   help="how long ranks wait for each other at start-up (default: --collective-timeout; "
                        "machines that start at different times need more)")
    p.add_argument("--follow-up-wait-ms", type=float, default=None, metavar="MS",
                   help="after a step that hands a request its answer, wait up to MS for the "
                        "conversation's next turn before a step of decodes alone, while most answers are "
                        "followed that soon (an agent's next turn; docs/follow-ups.md). Default: 20 on a "
                        "CPU, 0 (off) on a GPU")
    p.add_argument("--check-divergence", type=int, default=0, metavar="K",
                   help="every K steps, compare the TP ranks' scheduler-state digests and stop the "
                        "worker with an error naming the first differing field (0: off)")
    p.add_argument("--collective-timeout", type=float, default=60.0,
                   help="seconds a rank waits in a collective before it gives up")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="exit when the parent process dies (used by `pdserve serve`)")
    p.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    p.add_argument("--internal-token", default=None, metavar="TOKEN",
                   help="require 'Authorization: Bearer TOKEN' on every internal endpoint but /health, "
                        "/ready and /metrics (default: $PDSERVE_INTERNAL_TOKEN; none: open, as on loopback)")
    p.add_argument("--router-lease", type=float, default=0.0, metavar="S",
                   help="abort the requests in flight once no router called for S seconds (its probes "
                        "of /load renew the lease every --health-interval while requests run): a hung "
                        "or cut-off router never holds KV blocks for long (default 0: off)")
    p.add_argument("--served-model-name", default=None,
                   help="the model_name label of this worker's metrics: give the router's (default: "
                        "as the router derives it from --model)")


class DrainingServer(QuietServer):
    """SIGTERM/SIGINT: refuse new requests (503), let in-flight ones finish for up to the drain
    timeout, abort the rest (their clients get an error, their blocks return), then exit."""

    def __init__(self, worker: Worker, config: uvicorn.Config):
        super().__init__(config)
        self.worker = worker
        self._draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining:  # a second signal: stop now
            return super().handle_exit(sig, frame)
        self._draining = True
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        w = self.worker
        w.draining = True
        logger.info("draining: %d requests in flight", w.in_flight())
        deadline = time.monotonic() + w.settings.drain_timeout
        while w.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        for rid in w.in_flight_ids():
            logger.info("request %s: not finished at the drain timeout", rid, extra=about(rid))
            w.abort(rid, "abort", origin="drain")
        deadline = time.monotonic() + 5.0
        while w.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True


def worker_settings(args: argparse.Namespace, role: str) -> WorkerSettings:
    """The flags as settings; ValueError names the flags that do not fit together."""
    root = logging.getLogger().getEffectiveLevel()
    return WorkerSettings(
        role, args.worker_id, args.health_stall_timeout, args.drain_timeout, args.tp, args.check_divergence,
        args.collective_timeout, nnodes=args.nnodes, node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr, dist_init_timeout=args.dist_init_timeout,
        log_json=getattr(args, "log_json", False),
        rank_log_level="DEBUG" if root <= logging.DEBUG else "WARNING")


def run_worker(args: argparse.Namespace, role: str, engine_config) -> int:
    """Run a worker (or a follower node's ranks) until it stops; the process then exits with its
    status (`leave`). Returns only for settings refused before anything starts (2)."""
    try:
        settings = worker_settings(args, role)
        check(Settings(model=args.model, tp=args.tp, host=args.host, port=args.port,
                       kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                       block_size=args.block_size, dtype=args.dtype, device=args.device))
    except (ValueError, ConfigError) as e:  # before any rank is spawned or any weight is read
        print(f"pdserve {getattr(args, 'command', role)}: error: {e}", file=sys.stderr)
        return 2
    if args.exit_with_parent and sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    json_logs = settings.log_json
    # text or JSON, records about a request carry its id; with JSON, uvicorn's too (they propagate)
    setup_logging(json_logs, role if settings.layout.leader else f"{role}-tp{settings.layout.first}")
    if not settings.layout.leader:
        from .follower import run_follower

        leave(run_follower(settings, engine_config, args.host, args.port))
    try:  # held from now on: loading the model and starting the ranks takes seconds
        sock = bind_port(args.host, args.port)
    except ConfigError as e:
        print(f"pdserve {getattr(args, 'command', role)}: error: {e}", file=sys.stderr)
        return 2
    model_name, _ = served_name(args.model, args.served_model_name)
    server: uvicorn.Server | None = None

    def fatal() -> None:  # a dead rank or a divergence: the whole worker goes down
        if server is not None:
            server.should_exit = True

    # a test's faults (PDSERVE_TEST_FAULTS); None in production
    try:
        worker = Worker(engine_config, settings, on_fatal=fatal, model_name=model_name, faults=FaultPlan.from_env())
    except ContextDoesNotFit as e:  # a settings error, told in one line
        print(f"pdserve {getattr(args, 'command', role)}: error: {e}", file=sys.stderr)
        return 2
    worker.start()
    token = args.internal_token or os.environ.get("PDSERVE_INTERNAL_TOKEN", "").strip() or None
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("the internal API listens on %s without --internal-token: anyone who reaches it can "
                       "submit or abort requests", args.host)
    app = build_app(worker, model_name, token, args.router_lease)
    server = DrainingServer(worker, uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                                   access_log=False,
                                                   log_config=None if json_logs else uvicorn.config.LOGGING_CONFIG))
    logger.info("%s worker %s (tp=%d, %d node(s)) listening on http://%s:%d", role, worker.settings.worker_id,
                settings.tp, settings.nnodes, args.host, args.port)
    try:
        server.run(sockets=[sock])
    finally:
        if worker.error is not None:  # a rank died or diverged: the others wait in a collective
            for rank in worker.ranks:  # that can never complete; stopping them gently takes 10 s each
                rank.kill()
        worker.stop()
    leave(1 if worker.error else 0)
