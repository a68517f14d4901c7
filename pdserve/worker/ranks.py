"""TP ranks 1..N-1 of a worker: child processes that follow rank 0's plans and serve nothing.

They exit when rank 0's plan says shut down, when a collective fails (a peer died), or when
their parent dies (PDEATHSIG), so no rank is ever left waiting in a collective.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import signal
import socket
import sys

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(size: int, port: int, engine_config, settings) -> list[mp.Process]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(rank, size, port, engine_config, settings),
                         name=f"pdserve-tp{rank}", daemon=False) for rank in range(1, size)]
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


def share_bootstrap(comm, agent) -> list[str] | None:
    """Rank 0 gets every rank's transfer bootstrap (decode workers publish them)."""
    import torch.distributed as dist

    mine = agent.bootstrap_info().decode() if agent is not None and hasattr(agent, "bootstrap_info") else None
    if comm.size == 1:
        return [mine]
    out = [None] * comm.size if comm.rank == 0 else None
    dist.gather_object(mine, out, dst=0, group=comm.group)
    return out


def rank_main(rank: int, size: int, port: int, engine_config, settings) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # die with rank 0
    # a signal to the whole process group is rank 0's to handle: it drains, then its plan
    # tells every rank to stop; a rank that died on SIGTERM would break that shutdown
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    from pdserve.distributed.groups import init_tp
    from pdserve.engine.llm_engine import LLMEngine

    from .hooks import TestHooks

    tp, comm = init_tp(rank, size, port, engine_config.device, timeout_s=settings.collective_timeout)
    kv = {"both": "local", "prefill": "prefill", "decode": "decode"}[settings.role]
    engine = LLMEngine(engine_config, kv, tp, comm, digest_every=settings.check_divergence)
    agent = make_agent(settings.role, settings.worker_id, rank, engine)
    TestHooks.from_env(rank).install(engine)
    share_bootstrap(comm, agent)
    try:
        while True:
            plan, _ = engine.step()
            if plan.shutdown:
                break
    except Exception as e:  # a peer died mid-collective: exit, never wait
        logger.error("rank %d stops: %s", rank, e)
        sys.exit(1)
    finally:
        if agent is not None:
            agent.close()
