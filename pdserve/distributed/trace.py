"""A record of the collectives a rank enters: a running digest, and the full list when kept."""
from __future__ import annotations

import hashlib


class CollectiveTrace:
    def __init__(self, keep: bool = False):
        self.count = 0
        self.names: list[str] | None = [] if keep else None
        self._hash = hashlib.blake2b(digest_size=8)

    def record(self, name: str) -> None:
        self.count += 1
        self._hash.update(name.encode() + b"\0")
        if self.names is not None:
            self.names.append(name)

    def digest(self) -> str:
        return f"{self.count}:{self._hash.hexdigest()}"


class Traces:
    """Several traces read as one digest: with overlap, the model's collectives (forward
    thread) and the loop's (loop thread) are recorded apart, each in its own thread's order."""

    def __init__(self, *traces: CollectiveTrace):
        self.traces = traces

    def digest(self) -> str:
        return "/".join(t.digest() for t in self.traces)
