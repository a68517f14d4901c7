"""Node R > 0 of a multi-node TP group (`--node-rank R`): this node's ranks, and no worker API.

The main process runs the node's first rank (R * tp/nnodes) with the loop every rank > 0 runs
(`ranks.run_rank`); the node's other ranks are its child processes, as on node 0. Everything
else (requests, aborts, drain, shutdown) comes from rank 0's plans. For its pod's probes it
serves, on --host/--port:

* GET /health (liveness): 200 while this process follows the group and every child rank is
  alive (also while the model loads); 503 once a rank died or the group broke, just before
  the process exits. It does not watch progress: this node steps when rank 0 does, and rank
  0's own /health reports a stall.
* GET /ready: 200 from the node's first step (the group formed, every rank loaded its shard)
  until rank 0's plan says shut down.

Exit status: 0 when rank 0's plan said shut down (node 0 drained and stopped), 1 when the group
broke (a rank or node 0 died, a collective timed out) or never formed. SIGTERM is ignored, as
on every rank but 0: ranks that stopped on their own while node 0 drains would break the
group's collectives; node 0's plan stops them once it drained. SIGINT stops the node at once.
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import signal
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .ranks import run_rank, spawn_ranks

logger = logging.getLogger(__name__)

CHILD_EXIT_WAIT_S = 10.0  # after the main rank stopped: its children stop on the same plan


@dataclass
class NodeState:
    """What the probes report. Written by the rank loop (main thread), read by HTTP threads."""

    role: str
    node_rank: int
    ranks: range
    children: list[mp.Process] = field(default_factory=list)
    steps: int = 0
    last_step: float = field(default_factory=time.monotonic)
    stopping: bool = False          # rank 0's plan said shut down
    error: str | None = None

    def stepped(self) -> None:
        self.steps += 1
        self.last_step = time.monotonic()

    def health(self) -> tuple[int, dict]:
        dead = [p.name for p in self.children if not p.is_alive()]
        failed = self.error or (f"rank process {dead[0]} died" if dead and not self.stopping else None)
        status = "failed" if failed else "stopping" if self.stopping else "ok"
        body = {"status": status, "role": self.role, "node_rank": self.node_rank,
                "ranks": [self.ranks.start, self.ranks.stop - 1], "step": self.steps,
                "seconds_since_step": round(time.monotonic() - self.last_step, 3)}
        if failed:
            body["error"] = failed
        return (503 if failed else 200), body

    def ready(self) -> tuple[int, dict]:
        code, _ = self.health()
        ok = code == 200 and self.steps > 0 and not self.stopping
        return (200 if ok else 503), {"ready": ok}


def serve_probes(state: NodeState, host: str, port: int) -> ThreadingHTTPServer:
    """GET /health and /ready on a daemon thread (no access log: probes come every few seconds)."""

    class Probes(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            route = {"/health": state.health, "/ready": state.ready}.get(self.path.split("?")[0])
            code, body = route() if route else (404, {"error": "a follower node serves /health and /ready only"})
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
            pass

    server = ThreadingHTTPServer((host, port), Probes)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
    return server


def run_follower(settings, engine_config, host: str, port: int) -> int:
    """Run node `settings.node_rank`'s ranks until rank 0's plan stops them; the exit status."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    layout = settings.layout
    ranks = range(layout.first, layout.first + layout.per_node)
    state = NodeState(settings.role, layout.node_rank, ranks)
    probes = serve_probes(state, host, port)
    logger.info("%s node %d of %d: TP ranks %d..%d of %d, rendezvous at %s; probes on http://%s:%d",
                settings.role, layout.node_rank, layout.nnodes, ranks.start, ranks.stop - 1, settings.tp,
                settings.dist_init_addr, host, port)
    code = 1
    try:
        state.children = spawn_ranks(layout.children, engine_config, settings)
        code = run_rank(layout.first, engine_config, settings, on_step=state.stepped)
    except Exception as e:  # the group never formed (rendezvous timeout, model load failed)
        logger.exception("node %d cannot join the TP group", layout.node_rank)
        state.error = f"cannot join the TP group: {e}"
    except KeyboardInterrupt:
        state.error = "interrupted (SIGINT)"
    finally:
        state.stopping = code == 0
        if code:
            state.error = state.error or "the TP group broke"
        deadline = time.monotonic() + CHILD_EXIT_WAIT_S
        for p in state.children:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        probes.shutdown()
        probes.server_close()
    logger.info("node %d stops: %s", layout.node_rank,
                "rank 0 said shut down" if code == 0 else state.error)
    return code
