"""``Grammars``: one tokenizer's grammar backend, its compile cache, and the matchers in use.

Compiling takes milliseconds (more for a large schema), so it happens before a request
reaches a scheduler loop: at the router, which refuses a bad spec with a 400, and at the
worker's HTTP layer in a thread (``prepare``). The loop then only looks the grammar up. The
cache key is the spec itself; one ``Grammars`` serves one tokenizer, so (spec, tokenizer)
decides a compiled grammar. Failures are cached too: a bad spec sent again is refused fast.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from pdserve.worker_api import GrammarSpec

from .backend import GrammarBackend, GrammarError, Matcher

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 512


class GrammarObserver(Protocol):
    """Where compile and mask timings go (``pdserve.metrics.GrammarMetrics``)."""

    def grammar_compiled(self, seconds: float, cached: bool) -> None: ...

    def grammar_masked(self, seconds: float, rows: int) -> None: ...

    def grammar_matchers(self, live: int) -> None: ...


class GrammarState:
    """One sequence's matcher and how many of its output tokens it has consumed.

    ``sync`` replays the output tokens it has not seen: the tokens sampled since the last
    step, the first token a prefill worker sampled (on the decode worker), or the whole output
    of a preempted sequence recomputed with a fresh state. So the matcher is always exactly at
    the end of the output, whatever path the tokens came by."""

    __slots__ = ("matcher", "consumed", "_owner")

    def __init__(self, matcher: Matcher, owner: Grammars) -> None:
        self.matcher = matcher
        self.consumed = 0
        self._owner: Grammars | None = owner

    def sync(self, output_ids: Sequence[int]) -> None:
        for token in output_ids[self.consumed:]:
            if self.matcher.error is not None:
                break  # stuck for good: the sampler lets only EOS through
            if not self.matcher.consume(token):
                logger.warning("grammar refused token %d: %s", token, (self.matcher.error or "").splitlines()[0])
        self.consumed = len(output_ids)

    def release(self) -> None:
        """Idempotent: the owner stops counting this matcher."""
        if self._owner is not None:
            self._owner._released()
            self._owner = None


class Grammars:
    """The backend of one tokenizer (made on first use), its LRU compile cache, live matchers."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], capacity: int = DEFAULT_CAPACITY,
                 observer: GrammarObserver | None = None) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        self.observer = observer
        self.hits = 0
        self.misses = 0
        self.live = 0  # matchers started and not yet released
        self._pool: ThreadPoolExecutor | None = None

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                t0 = time.perf_counter()
                self._backend = self._make_backend()
                logger.info("grammar backend %s ready in %.2fs", self._backend.name, time.perf_counter() - t0)
            return self._backend

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar, from the cache when it is there; raises ``GrammarError``."""
        backend = self.backend
        spec = replace(spec, start_after=None)  # where it starts does not change the grammar
        t0 = time.perf_counter()
        with self._lock:
            found = self._cache.get(spec)
            hit = found is not None
            if hit:
                self._cache.move_to_end(spec)
                self.hits += 1
        if not hit:
            try:
                found = backend.compile(spec)
            except GrammarError as e:
                found = e
            with self._lock:
                self.misses += 1
                self._cache[spec] = found
                while len(self._cache) > self._capacity:
                    self._cache.popitem(last=False)
        if self.observer is not None:
            self.observer.grammar_compiled(time.perf_counter() - t0, cached=hit)
        if isinstance(found, GrammarError):
            raise found
        return found

    def check(self, spec: GrammarSpec) -> str | None:
        """None when `spec` compiles, else why not (the spec is cached either way)."""
        try:
            self.compile(spec)
        except GrammarError as e:
            return str(e)
        return None

    def start(self, spec: GrammarSpec) -> GrammarState:
        """A matcher at the start of `spec`'s grammar, counted until it is released."""
        state = GrammarState(self.backend.matcher(self.compile(spec)), self)
        with self._lock:
            self.live += 1
        self._report()
        return state

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` in this cache's one worker thread (the scheduler loop's mask jobs)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._pool.submit(fn, *args)

    def _released(self) -> None:
        with self._lock:
            self.live -= 1
        self._report()

    def _report(self) -> None:
        if self.observer is not None:
            self.observer.grammar_matchers(self.live)
