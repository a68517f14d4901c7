"""How many CPU threads each process of a worker runs.

torch's CPU kernels run OpenMP teams that spin while they wait for each other. When two busy
teams share a core, each waits for a member the OS descheduled, and a step gets many times
slower (≈15× measured on 2 cores) — so by default the threads of pdserve's processes on a machine
add up to at most its cores: a worker alone uses them all (split between its TP ranks),
`pdserve serve` divides them between its workers, an explicit `--threads` wins. A library user
(`LLM(...)`, tests) who gives no count keeps torch's process-wide setting.

One exception, measured: `pdserve serve --mode pd` with its one prefill and one decode worker on
the native CPU kernels gives each worker every core. Those kernels run on a pool whose helpers
spin only microseconds before yielding and then sleeping, so two workers that compute at once take
turns on the cores instead of stalling, and most of the time only one of them computes (prompts
come in bursts; the decode worker idles between streams). On 2 cores that was 1.2–1.4× the
throughput of one core each, a lower ITL p99, and no loss with long prompts computed beside
32 decodes (docs/cpu-threads.md has the figures). With `--kernels torch` (OpenMP teams
everywhere) the split stays.

Within a process, the cores serve one pool at a time. torch's OpenMP team spins for milliseconds
after each parallel op, on the very cores the native kernels' helpers need for the next matmul;
on 2 cores prompt and mixed steps took 1.3-1.6x as long that way. So where every matmul of the
model runs natively (`models.registry.multiplies_natively`: linear layers and LM heads in GGUF
blocks on the native kernels), torch keeps one thread (its remaining ops are small) and the
native kernels get the process's threads.
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
    shared: bool = False  # PD's prefill and decode worker each get every core and take turns

    @property
    def oversubscribed(self) -> bool:
        """More threads than cores where that was not planned: more processes than cores."""
        return not self.shared and self.per_process * self.processes > self.cores

    def describe(self) -> str:
        if self.shared:
            return (f"{self.per_process} thread(s) per process × {self.processes} process(es), the prefill "
                    f"and the decode worker sharing {self.cores} core(s)")
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


def serve_threads(mode: str, tp: int, cores: int | None = None, workers: int | None = None,
                  native: bool = True) -> ThreadPlan:
    """`pdserve serve`: the processes of its workers on this machine's cores. PD runs a prefill
    and a decode worker by default; with the native kernels (`native`) each gets every core (÷
    its TP ranks; see the module's docstring), else they split them. Colocated runs one worker.
    `workers`: how many it starts when told (--prefill-workers, --decode-workers, --workers);
    more than PD's two split the cores evenly between all of them. Each worker runs `tp` rank
    processes."""
    cores = cores or cpu_cores()
    workers = workers or (2 if mode == "pd" else 1)
    if mode == "pd" and workers == 2 and native:
        alone = split_threads(cores, max(1, tp))
        return ThreadPlan(cores, 2 * alone.processes, alone.per_process, shared=True)
    return split_threads(cores, workers * max(1, tp))


def default_threads(local_ranks: int = 1) -> int:
    """Threads for one of `local_ranks` rank processes of a worker alone on this machine (what
    the command line gives when --threads is not set)."""
    return split_threads(cpu_cores(), max(1, local_ranks)).per_process


def apply_threads(n: int, torch_threads: int | None = None) -> None:
    """Run this process's CPU work on `n` threads: the native kernels' pool and torch's intra-op
    threads, or `torch_threads` of them for torch (1 where every matmul is native; see the
    module's docstring). Says so."""
    import torch  # here, not at the top: the router imports this module and needs no torch

    from pdserve_kernels import cpu_lib

    cpu_lib.set_threads(n)
    torch.set_num_threads(torch_threads or n)
    if torch_threads and torch_threads != n:
        logger.info("CPU threads: %d for the native kernels, %d for torch's ops (every matmul is native) "
                    "(%d core(s) on the machine)", n, torch_threads, cpu_cores())
    else:
        logger.info("CPU threads: %d in this process (%d core(s) on the machine)", n, cpu_cores())
