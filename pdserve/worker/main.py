"""`pdserve prefill | decode | worker`: start a worker and serve its internal API."""
from __future__ import annotations

import argparse
import ctypes
import logging
import signal
import sys
import threading
import time

import uvicorn

from pdserve.logs import setup_logging

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
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of this worker (processes)")
    p.add_argument("--check-divergence", type=int, default=0, metavar="K",
                   help="every K steps, compare the TP ranks' scheduler-state digests and stop the "
                        "worker with an error naming the first differing field (0: off)")
    p.add_argument("--collective-timeout", type=float, default=60.0,
                   help="seconds a rank waits in a collective before it gives up")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="exit when the parent process dies (used by `pdserve serve`)")
    p.add_argument("--log-json", action="store_true", help="log one JSON object per line")


class DrainingServer(uvicorn.Server):
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
            logger.info("request %s: aborted by the drain timeout", rid)
            w.abort(rid, "abort", origin="drain")
        deadline = time.monotonic() + 5.0
        while w.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True


def run_worker(args: argparse.Namespace, role: str, engine_config) -> int:
    if args.exit_with_parent and sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    json_logs = getattr(args, "log_json", False)
    if json_logs:  # uvicorn's loggers too: they propagate to ours
        setup_logging(True, role)
    settings = WorkerSettings(role, args.worker_id, args.health_stall_timeout, args.drain_timeout,
                              args.tp, args.check_divergence, args.collective_timeout)
    server: uvicorn.Server | None = None

    def fatal() -> None:  # a dead rank or a divergence: the whole worker goes down
        if server is not None:
            server.should_exit = True

    worker = Worker(engine_config, settings, on_fatal=fatal, model_name=str(args.model or "default"))
    worker.start()
    app = build_app(worker, str(args.model or "default"))
    server = DrainingServer(worker, uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                                   access_log=False,
                                                   log_config=None if json_logs else uvicorn.config.LOGGING_CONFIG))
    logger.info("%s worker %s (tp=%d) listening on http://%s:%d", role, settings.worker_id, settings.tp,
                args.host, args.port)
    try:
        server.run()
    finally:
        worker.stop()
    return 1 if worker.error else 0
