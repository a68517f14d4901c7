"""The router process's one server object (settings, tokenizer, workers, clients, metrics, the
calls in flight), its lifecycle, and the uvicorn server that drains it on SIGTERM. Requests are
answered by ``requests`` with the router's ``Serving``; nothing request-scoped holds the router.

Liveness is the router's own: its event loop turns (a heartbeat task) and its background tasks
run; a worker outage never makes it fail, so an orchestrator does not restart routers for it.
Readiness is about workers: at least one prefill and one decode (or one colocated) worker
takes requests, and the router is not draining.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Coroutine
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from pdserve.frontend.admission import Admission, AdmissionConfig
from pdserve.frontend.choices import Services
from pdserve.frontend.config import RouterConfig
from pdserve.frontend.discovery import Discovery, Target, parse_target
from pdserve.frontend.errors import unavailable
from pdserve.frontend.output import ChatOutput
from pdserve.frontend.prompts import PromptBuilder
from pdserve.frontend.requests import Calls, Serving
from pdserve.frontend.response_store import ResponseStore
from pdserve.frontend.worker_client import WorkerClient
from pdserve.quiet_server import QuietServer
from pdserve.frontend.workers import WorkerPool
from pdserve.metrics import RouterMetrics
from pdserve.tokenizer import Tokenizer
from pdserve.worker_api import Role

logger = logging.getLogger(__name__)
_FALLBACK_CONTEXT = 2048
HEARTBEAT_S = 0.25
IDLE_HEARTBEAT_S = 1.0
STOPPED_GRACE_S = 5.0  # after the drain timeout: how long the stopped calls get to send their error
RESET_TIMEOUT_S = 30.0  # a prefix cache reset waits for each worker's next step


class Router:
    """The router process: its workers, its background tasks, its health, its drain."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        tokenizer = tokenizer or Tokenizer(config.model_dir)
        self.metrics = RouterMetrics(config.served_model_name)
        output = ChatOutput.load(config.model_dir, tokenizer, config.tool_call_parser)  # chat output parsing
        output.on_diagnostic = self.metrics.parser_diagnostic
        self.client = WorkerClient(config.connect_timeout_s, config.health_timeout_s, config.internal_token)
        self.pool = WorkerPool(self.client, config.prefill_urls, config.decode_urls, config.worker_urls,
                               interval_s=config.health_interval_s,
                               idle_interval_s=config.idle_health_interval_s, timeout_s=config.health_timeout_s,
                               slow_after_s=config.slow_after_s, dead_after_s=config.dead_after_s,
                               wedged_grace_s=config.wedged_grace_s)
        self.admission = Admission(self.pool, AdmissionConfig(
            max_queue=config.max_queue, queue_timeout_s=config.queue_timeout_s,
            worker_capacity=config.worker_capacity, max_running=config.max_running, routing=config.routing,
            ask_caches=config.ask_caches, local_prefill_tokens=config.local_prefill_tokens,
            scheduling_policy=config.scheduling_policy))
        self.metrics.watch_admission(self.admission)
        targets = _targets(config)
        self.discovery = Discovery(self.pool, targets, config.discover_interval_s) if targets else None
        self.pool.orchestrated = {t.role for t in targets}  # their pods come back when they die
        self.calls = Calls()
        services = Services(self.client, self.spawn, config.abort_timeout_s, self.metrics.aborted,
                            placer=self.admission, retries=config.retries, on_retry=self.metrics.retried)
        self.serving = Serving(config, tokenizer, PromptBuilder(tokenizer, config.inline_tokenize_chars), output,
                               self.pool, services, self.metrics, self.calls, _model_context(config),
                               self.admission, ResponseStore(config.responses_store))
        self.metrics.watch_responses(self.serving.responses)
        self.metrics.watch_prompts(self.serving.prompts)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._background: list[asyncio.Task[Any]] = []
        self._tick = time.monotonic()         # the heartbeat's last turn
        self._stalled_at = -1e9               # when it last found the loop `loop_stall_s` late

    async def start(self) -> None:
        """One round of discovery and probes first, so that a router started after its workers
        serves at once."""
        if self.discovery is not None:
            await self.discovery.refresh()
        await self.pool.probe_all()
        self._tick = time.monotonic()
        jobs: dict[str, Coroutine[Any, Any, None]] = {"worker-health": self.pool.run(),
                                                      "heartbeat": self._heartbeat()}
        if self.discovery is not None:
            jobs["discovery"] = self.discovery.run()
        self._background = [asyncio.create_task(job, name=name) for name, job in jobs.items()]
        logger.info("router for %s: %d worker(s), %s", self.config.served_model_name, len(self.pool.workers),
                    "ready" if self.pool.ready else "waiting for workers")

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
        if self._tasks:  # aborts still on their way
            await asyncio.wait(set(self._tasks), timeout=self.config.abort_timeout_s)
        await self.client.aclose()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` in the background, beyond the request that started it (aborts)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def draining(self) -> bool:
        return self.calls.draining

    @property
    def active(self) -> int:
        return self.calls.active

    async def reset_prefix_caches(self) -> dict[str, Any]:
        """POST /reset_prefix_cache (vLLM's): every worker in rotation forgets its prefix cache
        (and its host tier), the routing index forgets what it sent where, and the prompt
        tokenization forgets what it kept. A 503 names the workers that could not be reset; the
        others were."""
        workers = [w for w in self.pool.workers if w.in_rotation]
        results = await asyncio.gather(*(self.client.reset_prefix_cache(w.url, RESET_TIMEOUT_S) for w in workers),
                                       return_exceptions=True)
        self.admission.routing.forget()
        self.serving.prompts.prefixes.clear()
        failed = [f"{w.url} ({r})" for w, r in zip(workers, results) if isinstance(r, BaseException)]
        if not workers:
            raise unavailable("No worker is in rotation: no prefix cache could be reset.")
        if failed:
            raise unavailable(f"The prefix cache could not be reset on {', '.join(failed)}; the other workers' was.")
        logger.info("prefix cache reset on %d worker(s)", len(workers))
        return {"ok": True, "workers": [{"url": w.url, "role": w.role.value, "forgotten_blocks": n}
                                        for w, n in zip(workers, results)]}

    # ---- health and lifecycle ------------------------------------------------------------------

    def liveness(self) -> tuple[bool, str]:
        """(alive, status): the event loop is not stalled, nor was it in the last `loop_stall_s`
        seconds (a loop blocked again and again fails the probes that come between the blocks
        too), and no background task died."""
        now, stall = time.monotonic(), self.config.loop_stall_s
        if now - self._tick > stall or now - self._stalled_at < stall:
            return False, "stalled"
        if any(t.done() for t in self._background):
            return False, "failed"
        return True, "draining" if self.draining else "ok"

    @property
    def ready(self) -> bool:
        return self.pool.ready and not self.draining

    async def _heartbeat(self) -> None:
        beat = HEARTBEAT_S
        while True:
            now = time.monotonic()
            late = now - self._tick - beat
            if late > self.config.loop_stall_s:
                self._stalled_at = now
                logger.warning("the event loop stalled for %.1f s", late)
            self._tick = now
            # idle (no call in flight): a slower beat, still well inside loop_stall_s (idle CPU)
            beat = HEARTBEAT_S if self.active else min(IDLE_HEARTBEAT_S, self.config.loop_stall_s / 4)
            await asyncio.sleep(beat)

    async def drain(self, timeout_s: float) -> None:
        """Take no new requests (503); let those in flight finish for up to `timeout_s`; stop the
        rest with a 503 error (a stream's last event), which aborts their rooms on the workers;
        return once every call ended and the aborts were delivered."""
        self.calls.draining = True
        logger.info("draining: %d request(s) in flight; they have %.0f s to finish", self.active, timeout_s)
        if not await self._until_idle(timeout_s):
            self.calls.closing = True
            logger.warning("drain timeout: stopping %d request(s) still running", len(self.calls))
            error = unavailable("The server is shutting down; the request was stopped before it finished.")
            for call in self.calls:
                call.stop(error)
            if not await self._until_idle(STOPPED_GRACE_S):
                logger.error("%d request(s) still open after the drain", self.active)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.config.abort_timeout_s)
        logger.info("drained: no request in flight")

    async def _until_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.active


class RouterServer(QuietServer):
    """uvicorn serving the router app; SIGTERM or SIGINT drains the router (`Router.drain`),
    then the server exits (0). A second signal exits without waiting for the drain."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        # log_config=None: uvicorn's loggers go through ours (text or JSON, pdserve.logs).
        super().__init__(uvicorn.Config(app, host=host, port=port, access_log=False, log_level="warning",
                                        log_config=None, timeout_graceful_shutdown=5))
        self.router: Router = app.state.router
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._signalled = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not super(): it would re-raise the signal after serving, and the process would die of it.
        if self._signalled or self._loop is None or not self.started:
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self._signalled = True
        logger.info("%s: draining, then exiting", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.create_task(self._drain(), name="drain")

    async def _drain(self) -> None:
        try:
            await self.router.drain(self.router.config.drain_timeout_s)
        finally:
            self.should_exit = True


def _targets(config: RouterConfig) -> list[Target]:
    return ([parse_target(Role.PREFILL, t) for t in config.discover_prefill]
            + [parse_target(Role.DECODE, t) for t in config.discover_decode]
            + [parse_target(Role.BOTH, t) for t in config.discover_worker])


def _model_context(config: RouterConfig) -> int:
    """The model's own context length, until a worker reports the one it runs with."""
    try:
        cfg = json.loads((config.model_dir / "config.json").read_text(encoding="utf-8"))
        return int(cfg.get("max_position_embeddings") or _FALLBACK_CONTEXT)
    except (OSError, ValueError):
        return _FALLBACK_CONTEXT
