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
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import replace

from pdserve.logs import setup_logging

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(ranks: range, engine_config, settings) -> list[mp.Process]:
    """Start `ranks` (global TP ranks) as child processes of this node's main process."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(rank, engine_config, settings),
                         name=f"pdserve-tp{rank}", daemon=False) for rank in ranks]
    for p in procs:
        p.start()
    return procs


def make_agent(role: str, worker_id: str, rank: int, engine):
    """This rank's transfer agent over its KV pool shard (None for colocated workers)."""
    if role == "both":
        return None
    from pdserve.transfer import agent_name
    from pdserve.transfer.nixl_source import NixlSource
    from pdserve.transfer.nixl_target import NixlTarget

    cls = NixlTarget if role == "decode" else NixlSource
    agent = cls(agent_name(role, worker_id, rank), engine.pool.tensors())
    engine.attach_transfer(agent, rank)
    return agent


def group_worker_id(comm, worker_id: str) -> str:
    """Rank 0's worker id, on every rank. The transfer agents of all ranks are named after it
    (peers derive rank i's agent name from the worker id they know), and pods of a multi-node
    group each have their own --worker-id."""
    import torch.distributed as dist

    if comm.size == 1:
        return worker_id
    box = [worker_id if comm.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=comm.group)
    return str(box[0])


def share_bootstrap(comm, agent) -> list[str] | None:
    """Rank 0 gets every rank's transfer bootstrap (decode workers publish them)."""
    import torch.distributed as dist

    mine = agent.bootstrap_info().decode() if agent is not None and hasattr(agent, "bootstrap_info") else None
    if comm.size == 1:
        return [mine]
    out = [None] * comm.size if comm.rank == 0 else None
    dist.gather_object(mine, out, dst=0, group=comm.group)
    return out


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
    sys.exit(run_rank(rank, engine_config, settings))


def run_rank(rank: int, engine_config, settings, on_step: Callable[[], None] = lambda: None) -> int:
    """Join the group, load this rank's shard, then follow rank 0's plans until one says shut
    down (0) or a collective fails (1). `on_step` runs after every step (the follower's health)."""
    from pdserve.distributed.groups import init_tp
    from pdserve.engine.llm_engine import LLMEngine

    from .hooks import TestHooks

    engine_config = replace(engine_config, device=settings.layout.device(engine_config.device, rank))
    host, port = settings.rendezvous
    tp, comm = init_tp(rank, settings.tp, port, engine_config.device, settings.collective_timeout,
                       host=host, init_timeout_s=settings.dist_init_timeout)
    kv = {"both": "local", "prefill": "prefill", "decode": "decode"}[settings.role]
    engine = LLMEngine(engine_config, kv, tp, comm, digest_every=settings.check_divergence)
    agent = make_agent(settings.role, group_worker_id(comm, settings.worker_id), rank, engine)
    TestHooks.from_env(rank).install(engine)
    share_bootstrap(comm, agent)
    try:
        while True:
            plan, _ = engine.step()
            on_step()
            if plan.shutdown:
                return 0
    except Exception as e:  # a peer died mid-collective: exit, never wait
        logger.error("rank %d stops: %s", rank, e)
        return 1
    finally:
        if agent is not None:
            agent.close()
