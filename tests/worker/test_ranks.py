"""`dead_ranks`: a rank that is exiting when a step fails is seen dead, so the worker reports
the dead rank instead of the collective's transport error (a killed rank's sockets reset a
moment before its exit can be reaped)."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

from pdserve.worker.ranks import dead_ranks


def _wait_for_line(conn) -> None:
    conn.recv()


def test_a_killed_rank_is_seen_dead_at_once_and_a_live_one_after_the_wait():
    ctx = mp.get_context("fork")  # the target lives here; the worker spawns its ranks
    ends = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_wait_for_line, args=(child,), name=f"pdserve-tp{i + 1}")
             for i, (_, child) in enumerate(ends)]
    for p in procs:
        p.start()
    try:
        assert dead_ranks(procs) == []
        started = time.monotonic()
        assert dead_ranks(procs, wait=0.3) == []  # nothing exits: the whole wait, then none
        assert time.monotonic() - started >= 0.3
        os.kill(procs[1].pid, signal.SIGKILL)
        assert dead_ranks(procs, wait=30) == ["pdserve-tp2"]  # reaped within the wait, not after it
        ends[0][0].send("exit")
        procs[0].join(30)
        assert dead_ranks(procs) == ["pdserve-tp1", "pdserve-tp2"]
    finally:
        for p in procs:
            p.kill()
            p.join()
