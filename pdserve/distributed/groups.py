"""Process groups of one worker's TP ranks: the gloo world group carries the lockstep control
collectives, and on CPU the model's too; on GPU the model's collectives get their own nccl group.

One gloo group, not two: every gloo group runs a TCP loop thread that wakes about every 10 ms
even when nothing is sent (≈0.15 % of a core each, measured), which an idle worker should not
pay twice per rank (docs/liveness.md). Sharing is safe: every collective is synchronous and
every rank issues them in the same order (the lockstep plan's).

With overlap (docs/overlap.md) the model's collectives run on a forward thread while the loop
thread agrees and broadcasts: then they get a gloo group of their own, since two threads'
collectives on one group would pair up differently on each rank."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from .comm import GroupComm
from .group import TPGroup
from .layout import LOOPBACK
from .trace import CollectiveTrace


def init_tp(rank: int, size: int, port: int, device: str = "cpu", timeout_s: float = 60.0,
            trace: CollectiveTrace | None = None, host: str = LOOPBACK,
            init_timeout_s: float | None = None, overlap: bool = False) -> tuple[TPGroup, GroupComm]:
    """Join the TP group of `size` ranks rendezvousing on `host`:`port` (rank 0 listens there,
    on every interface). Ranks wait up to `init_timeout_s` (default `timeout_s`) for each other:
    on several machines they start at different times; every collective after that gives up
    after `timeout_s`."""
    wait = timedelta(seconds=timeout_s if init_timeout_s is None else init_timeout_s)
    store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=wait)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        import torch

        torch.cuda.set_device(device)  # NCCL binds each rank's communicator to the current GPU
    if backend != "gloo":
        model_group = dist.new_group(backend=backend)
    elif overlap:  # every rank asks for it (the flag is the worker's), in the same order
        model_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    else:
        model_group = dist.group.WORLD
    control = dist.group.WORLD
    trace = trace or CollectiveTrace()
    return TPGroup(rank, size, model_group, trace), GroupComm(rank, size, control, trace=trace)


def close_tp() -> None:
    """Leave the TP group: destroy its process groups, which joins gloo's threads. A process that
    exits with them still running can abort at exit ("terminate called without an active
    exception", SIGABRT), after all its work is done."""
    if dist.is_initialized():
        dist.destroy_process_group()
