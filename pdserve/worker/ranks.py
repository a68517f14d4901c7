"""The TP ranks a worker's node runs besides its main process: child processes that follow
rank 0's plans and serve nothing.

They exit when rank 0's plan says shut down, when a collective fails (a peer died), or when
their parent dies (PDEATHSIG), so no rank is ever left waiting in a collective. `run_rank` is
also the loop of a follower node's main process (follower.py).
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import wait as mp_wait

from pdserve.gloo_idle import preload_env
from pdserve.logs import setup_logging
from pdserve.ports import free_port  # noqa: F401  (the worker's import point for it)

logger = logging.getLogger(__name__)


def spawn_ranks(ranks: range, engine_config, settings) -> list[mp.Process]:
    """Start `ranks` (global TP ranks) as child processes of this node's main process."""
    # idle ranks without gloo's 10 ms tick: LD_PRELOAD reaches the spawned interpreters
    os.environ.update(preload_env())
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(rank, engine_config, settings),
                         name=f"pdserve-tp{rank}", daemon=False) for rank in ranks]
    for p in procs:
        p.start()
    return procs


def dead_ranks(procs: list[mp.Process], wait: float = 0.0) -> list[str]:
    """The names of the rank processes that have exited. `wait`: when none has, give one that
    is exiting that long to finish (a killed rank's sockets are reset, and fail a collective, a
    moment before its exit can be reaped)."""
    if wait and procs and all(p.is_alive() for p in procs):
        ready = mp_wait([p.sentinel for p in procs], timeout=wait)
        for p in procs:
            if p.sentinel in ready:
                p.join(timeout=wait)  # reaped: is_alive() says so
    return [p.name for p in procs if not p.is_alive()]


def rank_main(rank: int, engine_config, settings) -> None:
    """A child process: one TP rank of this node."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # die with the node's main process
    # a signal to the whole process group is rank 0's to handle: it drains, then its plan
    # tells every rank to stop; a rank that died on SIGTERM would break that shutdown
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(settings.log_json, f"{settings.role}-tp{rank}", settings.rank_log_level,
                  f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    leave(run_rank(rank, engine_config, settings))


def run_rank(rank: int, engine_config, settings, on_step: Callable[[], None] = lambda: None) -> int:
    """Join the group, load this rank's shard, then follow rank 0's plans until one says shut
    down (0) or a collective fails or a plan carries an error (1). `on_step` runs after every
    step (the follower's health)."""
    from .faults import FaultPlan
    from .runtime import RankRuntime

    runtime = RankRuntime(rank, engine_config, settings, FaultPlan.from_env())
    runtime.connect()
    try:
        runtime.run(_Follow(on_step))
        return 0
    except Exception as e:  # a peer died mid-collective, or the ranks diverged: exit, never wait
        logger.error("rank %d stops: %s", rank, e)
        return 1
    finally:
        runtime.close()


class _Follow:
    """A rank other than 0 asks for nothing: it runs what rank 0's plans say."""

    def __init__(self, on_step: Callable[[], None]):
        self.on_step = on_step

    def before_step(self) -> bool:
        return False

    def after_step(self, plan, outputs) -> None:
        self.on_step()


def leave(code: int) -> None:
    """Exit a worker or rank process that has stopped in order (drained, its ranks joined, its
    transfer agent closed) without the interpreter's teardown: the native objects still alive then (the
    NIXL agent, gloo's threads) are destroyed in no defined order, which once aborted a worker
    (SIGABRT, "terminate called without an active exception") after its peer had died."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
