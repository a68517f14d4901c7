"""A bounded memory of ids that ended recently, oldest forgotten first."""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class RecentIds:
    """Ids remembered for `ttl_s` seconds (None: until `capacity` newer ones push them out).

    Not thread-safe: each owner uses it from one thread."""

    def __init__(self, capacity: int = 100_000, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.capacity, self.ttl_s, self._clock = capacity, ttl_s, clock
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, rid: str) -> None:
        self._ids[rid] = self._clock()
        self._ids.move_to_end(rid)
        self._forget()

    def __contains__(self, rid: str) -> bool:
        self._forget()
        return rid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def _forget(self) -> None:
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        if self.ttl_s is None:
            return
        now = self._clock()
        while self._ids and now - next(iter(self._ids.values())) >= self.ttl_s:
            self._ids.popitem(last=False)
