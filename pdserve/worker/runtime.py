"""One TP rank of a worker: the same set-up and the same loop on rank 0 and on every other rank.

`RankRuntime` joins the TP group, loads this rank's shard, makes its transfer agent and runs
the lockstep loop (scheduler/lockstep.py). What differs between ranks is not here: rank 0's
worker process (worker.py) feeds the inbox and handles outputs through a `StepHooks`; the other
ranks (ranks.py) only follow rank 0's plans.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Protocol

from pdserve.distributed.groups import init_tp
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import KVRole
from pdserve.scheduler.plan import StepOutput, StepPlan

from .faults import FaultPlan

logger = logging.getLogger(__name__)


class StepHooks(Protocol):
    """What a rank does around its steps (rank 0: the API's side; other ranks: their health)."""

    def before_step(self) -> bool:
        """Called before each step; True asks for shutdown (rank 0 only: its plan says so)."""

    def after_step(self, plan: StepPlan, outputs: list[StepOutput]) -> None:
        """Called after each step that did not shut down."""


class RankRuntime:
    """One rank: its engine, its transfer agent, its loop. `settings` are the worker's
    (`WorkerSettings`); `faults` a test's fault plan (None in production)."""

    def __init__(self, rank: int, engine_config: EngineConfig, settings,
                 faults: FaultPlan | None = None):
        self.rank, self.settings, self.faults = rank, settings, faults
        engine_config = replace(engine_config, device=settings.layout.device(engine_config.device, rank))
        tp = comm = None
        if settings.tp > 1:
            host, port = settings.rendezvous
            tp, comm = init_tp(rank, settings.tp, port, engine_config.device, settings.collective_timeout,
                               host=host, init_timeout_s=settings.dist_init_timeout,
                               overlap=engine_config.overlap)
        self.engine = LLMEngine(engine_config, KVRole.of_worker(settings.role), tp, comm,
                                digest_every=settings.check_divergence)
        self.agent = None
        self.bootstrap: list[str] | None = None  # rank 0: every rank's transfer bootstrap

    def connect(self) -> None:
        """Make this rank's transfer agent and gather the bootstraps on rank 0 (collectives
        every rank runs in this order). Call it on the thread that will run the loop: a NIXL
        agent is used by one thread only."""
        worker_id = group_worker_id(self.engine.comm, self.settings.worker_id)
        self.agent = make_agent(self.settings.role, worker_id, self.rank, self.engine.pool)
        if self.agent is not None:
            link = self.engine.attach_transfer(self.agent, self.rank)
            if self.faults is not None:
                self.engine.attach_link(self.faults.wrap(link, self.rank))
        self.bootstrap = share_bootstrap(self.engine.comm, self.agent)

    def run(self, hooks: StepHooks) -> None:
        """Step until a plan says shut down; a plan's error (a divergence) raises. The outputs
        went out during the step (`LockstepLoop.emit`); with overlap the last forward is waited
        for on the way out."""
        try:
            while True:
                plan, outputs = self.engine.step(shutdown=hooks.before_step())
                if plan.error:
                    raise RuntimeError(plan.error)
                if plan.shutdown:
                    return
                hooks.after_step(plan, outputs)
        finally:
            self.engine.close()

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None


def make_agent(role: str, worker_id: str, rank: int, pool):
    """This rank's transfer agent over its KV pool shard (None for colocated workers)."""
    kv = KVRole.of_worker(role)
    if kv is KVRole.LOCAL:
        return None
    from pdserve.transfer import agent_name
    from pdserve.transfer.nixl_source import NixlSource
    from pdserve.transfer.nixl_target import NixlTarget

    cls = NixlTarget if kv is KVRole.DECODE else NixlSource
    return cls(agent_name(kv.value, worker_id, rank), pool.tensors())


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
