"""The lockstep harness with overlap: 2 real gloo ranks, each forward on its own thread doing real
collectives on the model's process group (a placeholder broadcast, an all_reduce) while the loop
thread agrees and broadcasts the next plan on the control group; random admissions, aborts and
rank-local transfer outcomes land while a forward is in flight. Every rank keeps the same state
after every step, and ends with empty schedulers and a full pool. 2,000 steps, not the plain
harness's 10,000: an overlapped step here costs ≈8 ms on a busy 2-core machine (two threads per
rank waking each other), so 10,000 would take ≈80 s of the test budget (docs/overlap.md).
`make lockstep-soak` runs it with PDSERVE_LOCKSTEP_STEPS=10000 (the spawned ranks read the same
variable when they import this module)."""
from __future__ import annotations

import os
import random

import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import KVRole
from pdserve.kvcache import BlockAllocator
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig
from pdserve.scheduler.lockstep import LockstepLoop, state_digest
from pdserve.scheduler.plan import KVPeer, SampledToken

from tests.scheduler.lockstep_ranks import RandomInbox, run_ranks
from tests.scheduler.test_lockstep_harness import RandomTransfers

STEPS = int(os.environ.get("PDSERVE_LOCKSTEP_STEPS", "2000"))
DRAIN = 100


def mixed_request(rid: str, rng: random.Random) -> NewRequest:
    """A decode room or a colocated request, 1-30 prompt tokens, up to 12 output tokens."""
    kv = KVRole.DECODE if rng.random() < 0.5 else KVRole.LOCAL
    return NewRequest(rid, [5] * rng.randint(1, 30), SamplingParams(temperature=0, max_tokens=rng.randint(1, 12)),
                      kv=kv, peer=KVPeer("p") if kv is KVRole.DECODE else None)


def rank_main(rank: int, port: int, results) -> None:
    from pdserve.distributed.group import TPGroup
    from pdserve.distributed.groups import init_tp
    from pdserve.distributed.trace import CollectiveTrace, Traces

    torch.set_num_threads(1)
    tp, comm = init_tp(rank, 2, port, timeout_s=60, overlap=True)
    comm.trace = CollectiveTrace(keep=True)
    model_trace = CollectiveTrace(keep=True)
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
    inbox = RandomInbox(mixed_request, STEPS, DRAIN, abort_p=0.3)  # rank 0's
    digests = []
    for step in range(STEPS):
        plan, _ = loop.step(inbox.at(step) if rank == 0 else Inbox())
        inbox.drop(r.request_id for r in plan.deferred)
        assert plan.error is None, plan.error
        digests.append(state_digest(sched, ""))
    loop.close()
    sched.allocator.check_integrity()
    assert not sched.has_work(), (list(sched.seqs), list(sched.held))
    results.put((rank, comm.trace.names, model_trace.names, digests, sched.allocator.num_free, placeholders[0]))


@pytest.mark.e2e
@pytest.mark.timeout(300 + STEPS // 20)
def test_overlapped_steps_keep_ranks_identical():
    got = run_ranks(rank_main, timeout=250 + STEPS // 20)
    (ctl0, model0, dig0, free0, ph0), (ctl1, model1, dig1, free1, ph1) = got[0], got[1]
    assert len(ctl0) == 2 * STEPS
    assert ctl0 == ctl1 and model0 == model1  # the same collectives, in the same order, per group
    assert dig0 == dig1                        # the same state after every step
    assert free0 == free1 == 48                # every block came back
    assert ph0 == ph1 > 100                    # decodes ran on placeholders
