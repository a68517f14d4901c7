"""The router's lease on a worker's requests: a router that stops talking to a worker (it hung,
or a network partition cut it off while its connections stay open) must not hold the worker's
KV blocks forever. A router that died outright closes its connections, and the worker frees
what those requests held at once; this covers the router that is silent but not gone.

Every call from a router renews the lease: its probes of /load (every ``--health-interval``
while something runs here), /generate, /prefill and /abort. With ``--router-lease S`` (0: off),
once no call came for S seconds while requests are in flight, the worker aborts them (origin
"timeout"): their rooms end and their blocks come back, as with any abort.
"""
from __future__ import annotations

import time
from collections.abc import Callable


class RouterLease:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self._clock = clock
        self.renewed = clock()

    @property
    def enabled(self) -> bool:
        return self.lease_s > 0

    def renew(self) -> None:
        self.renewed = self._clock()

    def expired(self) -> bool:
        return self.enabled and self._clock() - self.renewed >= self.lease_s

    def silence(self) -> float:
        return self._clock() - self.renewed
