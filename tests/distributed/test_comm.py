"""The lockstep collectives over real gloo ranks: a plan larger than the broadcast buffer (one
request's long prompt or large grammar) reaches every rank whole, by a second broadcast whose
size every rank read from the first; plans that fit take one broadcast, as before."""
from __future__ import annotations

import random

import torch

from pdserve.distributed.comm import frame

from tests.scheduler.lockstep_ranks import run_ranks

BUFFER = 4096  # a small plan buffer, so that a few KB overflow it


def of_frame_size(n: int) -> bytes:
    """A plan whose frame (length header + pickle) is exactly `n` bytes."""
    overhead = len(frame(b""))
    plan = b"x" * (n - overhead)
    while len(frame(plan)) > n:  # a longer bytes object may take a longer length field
        plan = plan[:-1]
    assert len(frame(plan)) == n
    return plan


def plans() -> list[object]:
    """Plans of every size around the buffer's, and far past it (rank 0 sends them in order)."""
    rng = random.Random(3)
    prompt = [rng.randrange(1 << 17) for _ in range(50_000)]  # ids past 65,535 pickle to 5 bytes each
    return [None, of_frame_size(BUFFER - 1), of_frame_size(BUFFER), of_frame_size(BUFFER + 1),
            {"step": 4, "admitted": prompt}, {"step": "small again"}, of_frame_size(3 * BUFFER)]


def rank_main(rank: int, port: int, results) -> None:
    from pdserve.distributed.groups import init_tp
    from pdserve.distributed.trace import CollectiveTrace

    torch.set_num_threads(1)
    _, comm = init_tp(rank, 3, port, timeout_s=60)
    comm.trace = CollectiveTrace(keep=True)
    comm.plan_bytes = BUFFER
    comm._plan_buf = torch.zeros(BUFFER, dtype=torch.uint8)
    got = [comm.broadcast(plan if rank == 0 else None) for plan in plans()]
    results.put((rank, got, comm.trace.names))


def test_plans_past_the_buffer_arrive_whole_on_every_rank():
    out = run_ranks(rank_main, size=3, timeout=120)
    expected = plans()
    for rank in range(3):
        got, names = out[rank]
        assert got == expected, rank
        assert names == out[0][1]  # the same collectives, in the same order, on every rank
    # one broadcast each; a second for the three plans that do not fit, and only for them
    assert out[0][1] == [name for plan in expected
                         for name in ("broadcast", "broadcast-rest")[:1 + (len(frame(plan)) > BUFFER)]]
    assert out[0][1].count("broadcast-rest") == 3
