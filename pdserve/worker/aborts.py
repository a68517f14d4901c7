"""Which aborts a worker counts, and by which origin (`pdserve:aborts_total{origin}`).

A request is counted at most once, and only if it was still running here when its abort came:
an abort of an unknown or finished request stays a no-op (the router may release a request
and abort it after the worker finished it; a finished request was not aborted), and a second
abort of the same request changes nothing.

The origin is the one the router names in POST /abort. The router also closes the request's
stream, usually *before* its /abort arrives. A closed stream therefore aborts the request at
once (its blocks must come back) but leaves the count pending for `grace_s`: the /abort that
follows names the origin; a stream closed with no /abort (the router died, or a client other
than the router went away) counts as "client" when the grace period ends.

This is metrics bookkeeping, not a memory of aborted ids: it never refuses or ends a request
(the engine's `RecentIds` and the rooms' tombstones do), and it forgets a request once counted.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable


class AbortLedger:
    def __init__(self, count: Callable[[str], None], grace_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self._count = count        # count(origin): one abort of one request
        self.grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._live: set[str] = set()          # running here, abort not counted yet
        self._pending: dict[str, float] = {}  # stream closed, origin not told yet: since when

    def started(self, rid: str) -> None:
        with self._lock:
            self._live.add(rid)

    def finished(self, rid: str) -> None:
        """The request's last output (any reason). A pending count stays pending."""
        with self._lock:
            self._live.discard(rid)

    def told(self, rid: str, origin: str) -> bool:
        """POST /abort (or the drain) with its origin. True when this counted an abort."""
        with self._lock:
            counted = self._pending.pop(rid, None) is not None or rid in self._live
            self._live.discard(rid)
        if counted:
            self._count(origin)
        return counted

    def reader_left(self, rid: str) -> bool:
        """The request's stream closed before its finish. True when a count is now pending."""
        with self._lock:
            if rid not in self._live:
                return False
            self._live.discard(rid)
            self._pending[rid] = self._clock()
            return True

    def sweep(self) -> int:
        """Count as "client" the pending aborts whose grace period ended; how many."""
        now = self._clock()
        with self._lock:
            due = [rid for rid, since in self._pending.items() if now - since >= self.grace_s]
            for rid in due:
                del self._pending[rid]
        for _ in due:
            self._count("client")
        return len(due)
