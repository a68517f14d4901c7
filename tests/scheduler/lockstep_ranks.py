"""What the lockstep harnesses share: rank processes over real gloo, and rank 0's random inbox."""
from __future__ import annotations

import multiprocessing as mp
import random
import socket
from collections.abc import Callable, Iterable

from pdserve.engine.sequence import FinishReason
from pdserve.scheduler import Inbox, NewRequest


def run_ranks(target: Callable, *args, size: int = 2, timeout: float = 500) -> dict[int, tuple]:
    """Start `size` spawned processes running `target(rank, port, results, *args)`; each puts
    `(rank, *its result)` on `results`. Returns every rank's result by rank, once all exited 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(target, r, port, results, *args)) for r in range(size)]
    for p in procs:
        p.start()
    got = {r[0]: r[1:] for r in (results.get(timeout=timeout) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return got


def _rank(target: Callable, rank: int, port: int, results, *args) -> None:
    """One rank: `target`, then leave the group (so that the process exits 0: `close_tp`)."""
    from pdserve.distributed.groups import close_tp

    target(rank, port, results, *args)
    close_tp()


class RandomInbox:
    """Rank 0's inbox of a harness step: 0-2 new requests (`new(request_id, rng)` makes each),
    an abort of a live request with probability `abort_p`; in the last `drain` steps, an abort
    of everything live and no admissions. Requests that end without an abort of the harness
    (deferred, rejected, cancelled) are given to `drop`, so that `live` stays short."""

    def __init__(self, new: Callable[[str, random.Random], NewRequest], steps: int, drain: int,
                 abort_p: float, rng: random.Random | None = None):
        self.new, self.steps, self.drain, self.abort_p = new, steps, drain, abort_p
        self.rng = rng or random.Random(42)
        self.live: list[str] = []
        self.next_id = 0

    def at(self, step: int) -> Inbox:
        if step >= self.steps - self.drain:  # the end: abort everything, admit nothing
            inbox = Inbox(aborts=[(rid, FinishReason.ABORT) for rid in self.live])
            self.live = []
            return inbox
        inbox = Inbox()
        for _ in range(self.rng.choice([0, 0, 1, 2])):
            rid = f"r{self.next_id}"
            self.next_id += 1
            inbox.new.append(self.new(rid, self.rng))
            self.live.append(rid)
        if self.live and self.rng.random() < self.abort_p:
            inbox.aborts.append((self.rng.choice(self.live), FinishReason.ABORT))
        return inbox

    def drop(self, request_ids: Iterable[str]) -> None:
        ended = set(request_ids)
        if ended:  # once per step: `live` grows to thousands
            self.live = [rid for rid in self.live if rid not in ended]
