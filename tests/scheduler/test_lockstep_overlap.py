"""The lockstep harness with overlap: 2 real gloo ranks, each forward on its own thread doing real
collectives on the model's process group (a placeholder broadcast, an all_reduce) while the loop
thread agrees and broadcasts the next plan on the control group; random admissions, aborts and
rank-local transfer outcomes land while a forward is in flight. Every rank keeps the same state
after every step (a shorter run than the plain harness's 10,000 steps: each step here waits for
a thread hand-off), and ends with empty schedulers and a full pool."""
from __future__ import annotations

import multiprocessing as mp
import random
import socket

import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import KVRole
from pdserve.kvcache import BlockAllocator
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig
from pdserve.scheduler.lockstep import LockstepLoop, state_digest
from pdserve.scheduler.plan import KVPeer, SampledToken
from tests.scheduler.test_lockstep_harness import RandomTransfers

STEPS = 2_000
DRAIN = 100


def rank_main(rank: int, port: int, results) -> None:
    from pdserve.distributed.groups import init_tp
    from pdserve.distributed.trace import CollectiveTrace, Traces

    torch.set_num_threads(1)
    tp, comm = init_tp(rank, 2, port, timeout_s=60, overlap=True)
    comm.trace = CollectiveTrace(keep=True)
    model_trace = CollectiveTrace(keep=True)
    from pdserve.distributed.group import TPGroup
    tp = TPGroup(tp.rank, tp.size, tp.group, model_trace)
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=16, max_num_batched_tokens=64,
                                      max_model_len=256, overlap=True), BlockAllocator(48), frozenset({2}))
    tokens = random.Random(7)
    placeholders = [0]

    def stage_batch(batch, sample, previous):
        last = {t.request_id: t.token_id for t in previous}
        futures = [s.request_id for s, start, n in batch if start + n > s.num_tokens]
        values = torch.tensor([last[r] for r in futures] if rank == 0 else [0] * len(futures), dtype=torch.long)
        ends = [s.request_id for s, start, n in batch if start + n >= s.num_tokens]

        def job():
            if futures:  # rank 0's tokens for the placeholders, on the model's group
                tp.broadcast(values)
                placeholders[0] += len(futures)
            tp.all_reduce(torch.ones(4))  # the "model"
            return [SampledToken(r, tokens.randrange(3, 50)) for r in ends] if sample else []
        return job

    loop = LockstepLoop(sched, comm, None, RandomTransfers(rank), digest_every=50,
                        trace=Traces(comm.trace, model_trace), stage_batch=stage_batch)
    rng = random.Random(42)  # rank 0's inbox
    digests, next_id, live = [], 0, []
    for step in range(STEPS):
        inbox = Inbox()
        if rank == 0:
            for _ in range(rng.choice([0, 0, 1, 2])):
                rid = f"r{next_id}"
                next_id += 1
                kv = KVRole.DECODE if rng.random() < 0.5 else KVRole.LOCAL
                inbox.new.append(NewRequest(rid, [5] * rng.randint(1, 30),
                                            SamplingParams(temperature=0, max_tokens=rng.randint(1, 12)),
                                            kv=kv, peer=KVPeer("p") if kv is KVRole.DECODE else None))
                live.append(rid)
            if live and rng.random() < 0.3:
                inbox.aborts.append((rng.choice(live), "abort"))
        if rank == 0 and step >= STEPS - DRAIN:  # the end: abort everything, admit nothing
            inbox = Inbox(aborts=[(rid, "abort") for rid in live])
            live = []
        plan, _ = loop.step(inbox)
        if rank == 0 and plan.deferred:
            deferred = {r.request_id for r in plan.deferred}
            live = [rid for rid in live if rid not in deferred]
        assert plan.error is None, plan.error
        digests.append(state_digest(sched, ""))
    loop.close()
    sched.allocator.check_integrity()
    assert not sched.has_work(), (list(sched.seqs), list(sched.held))
    results.put((rank, comm.trace.names, model_trace.names, digests, sched.allocator.num_free, placeholders[0]))


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_overlapped_steps_keep_ranks_identical():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r[0], r[1:]) for r in (results.get(timeout=250) for _ in procs))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    (ctl0, model0, dig0, free0, ph0), (ctl1, model1, dig1, free1, ph1) = got[0], got[1]
    assert len(ctl0) == 2 * STEPS
    assert ctl0 == ctl1 and model0 == model1  # the same collectives, in the same order, per group
    assert dig0 == dig1                        # the same state after every step
    assert free0 == free1 == 48                # every block came back
    assert ph0 == ph1 > 100                    # decodes ran on placeholders
