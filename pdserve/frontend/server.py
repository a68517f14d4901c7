"""The router process's one server object: settings, tokenizer, workers, clients, metrics."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine
from typing import Any

from pdserve.frontend.backend import WorkerClient
from pdserve.frontend.choice import Services
from pdserve.frontend.config import RouterConfig
from pdserve.frontend.errors import model_not_found
from pdserve.frontend.ids import RequestIds
from pdserve.frontend.metrics import RouterMetrics
from pdserve.frontend.prompts import PromptBuilder
from pdserve.frontend.workers import Worker, WorkerPool
from pdserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
_FALLBACK_CONTEXT = 2048


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or Tokenizer(config.model_dir)
        self.prompts = PromptBuilder(self.tokenizer, config.inline_tokenize_chars)
        self.metrics = RouterMetrics()
        self.ids = RequestIds()
        self.client = WorkerClient(config.connect_timeout_s, config.health_timeout_s)
        self.pool = WorkerPool(self.client, config.prefill_urls, config.decode_urls, config.worker_urls,
                               interval_s=config.health_interval_s, timeout_s=config.health_timeout_s,
                               dead_after_s=config.dead_after_s, wedged_grace_s=config.wedged_grace_s,
                               on_health=self._on_health)
        self.services = Services(self.client, self.spawn, config.abort_timeout_s,
                                 lambda reason: self.metrics.aborts.labels(reason).inc())
        self._model_context = _model_context(config)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._poller: asyncio.Task[None] | None = None
        for w in self.pool.workers:
            self._on_health(w)

    async def start(self) -> None:
        """One round of probes first, so that a router started after its workers serves at once."""
        await self.pool.probe_all()
        self._poller = asyncio.create_task(self.pool.run(), name="worker-health")
        logger.info("router for %s: %d worker(s), %s", self.config.served_model_name, len(self.pool.workers),
                    "ready" if self.pool.ready else "waiting for workers")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._tasks:  # aborts still on their way
            await asyncio.wait(set(self._tasks), timeout=self.config.abort_timeout_s)
        await self.client.aclose()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` in the background, beyond the request that started it (aborts)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def check_model(self, name: str | None) -> str:
        """The served name for a request's "model" (None means the served model); else 404."""
        if name is None or name in self.config.model_names:
            return self.config.served_model_name
        raise model_not_found(name)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len or self.pool.max_model_len or self._model_context

    def _on_health(self, w: Worker) -> None:
        self.metrics.worker_up.labels(w.url, w.role.value).set(1 if w.available else 0)


def _model_context(config: RouterConfig) -> int:
    """The model's own context length, until a worker reports the one it runs with."""
    try:
        cfg = json.loads((config.model_dir / "config.json").read_text(encoding="utf-8"))
        return int(cfg.get("max_position_embeddings") or _FALLBACK_CONTEXT)
    except (OSError, ValueError):
        return _FALLBACK_CONTEXT
