"""How many CPU threads each process of a worker runs: the cores, shared, never oversubscribed.

torch's CPU kernels run OpenMP teams that spin while they wait for each other. When two teams
share a core, each waits for a member the OS descheduled, and a step gets many times slower
(≈15× measured on 2 cores) — so the threads of every process on the machine add up to at most
its cores. A worker alone uses them all (split between its TP ranks); `pdserve serve` divides
them between its workers; an explicit `--threads` wins. A library user (`LLM(...)`, tests) who
gives no count keeps torch's process-wide setting.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadPlan:
    """Threads per process for `processes` processes sharing `cores` cores."""

    cores: int
    processes: int
    per_process: int

    @property
    def oversubscribed(self) -> bool:
        """More processes than cores: even one thread each exceeds the cores."""
        return self.per_process * self.processes > self.cores

    def describe(self) -> str:
        used = self.per_process * self.processes
        more = " (more processes than cores: they will slow each other down)" if self.oversubscribed else ""
        return (f"{self.per_process} thread(s) per process × {self.processes} process(es) "
                f"= {used} of {self.cores} core(s){more}")


def split_threads(cores: int, processes: int) -> ThreadPlan:
    """An even split, at least one thread each. With more processes than cores the total must
    exceed the cores; one thread each is then the least oversubscription possible."""
    if cores < 1 or processes < 1:
        raise ValueError(f"need at least one core and one process, got {cores} and {processes}")
    return ThreadPlan(cores, processes, max(1, cores // processes))


def serve_threads(mode: str, tp: int, cores: int | None = None, workers: int | None = None) -> ThreadPlan:
    """`pdserve serve`: the processes of its workers share this machine's cores. PD runs a
    prefill and a decode worker by default (on 2 cores: one thread each; both run during a
    request's handover, and decode streams while prefill serves the next prompt); colocated runs
    one. `workers`: how many it starts when told (--prefill-workers, --decode-workers,
    --workers); the cores are split evenly between all of them. Each worker runs `tp` rank
    processes."""
    workers = workers or (2 if mode == "pd" else 1)
    return split_threads(cores or cpu_cores(), workers * max(1, tp))


def default_threads(local_ranks: int = 1) -> int:
    """Threads for one of `local_ranks` rank processes of a worker alone on this machine (what
    the command line gives when --threads is not set)."""
    return split_threads(cpu_cores(), max(1, local_ranks)).per_process


def apply_threads(n: int) -> None:
    """Set torch's intra-op threads of this process to `n` and say so."""
    import torch  # here, not at the top: the router imports this module and needs no torch

    torch.set_num_threads(n)
    logger.info("CPU threads: %d in this process (%d core(s) on the machine)", n, cpu_cores())
