"""A plan's tokens reach the other TP ranks without their logprobs (2 real gloo ranks).

64 sequences decode together, every token with 20 top logprobs (≈ 480 bytes pickled with
DeepSeek-sized ids): with the logprobs, a step's plan needs ≈ 30 KB, past the 16 KiB plan buffer
given here, and would take the second broadcast every step. Only rank 0's outputs reach clients,
so the others get the ids alone: every plan fits one broadcast, rank 0 still reports each token's
own logprobs, and both ranks keep the same state."""
from __future__ import annotations

import random

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import TokenLogprobs
from pdserve.kvcache import BlockAllocator
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig
from pdserve.scheduler.lockstep import LockstepLoop
from pdserve.scheduler.plan import SampledToken

from tests.scheduler.lockstep_ranks import run_ranks

SEQS = 64
OUTPUT = 4
VOCAB = 129_280  # DeepSeek's: ids past 65,535 pickle to 5 bytes


def token(rid: str, index: int) -> SampledToken:
    """Output token `index` of `rid`, with 20 top logprobs: a function of both, so a report
    that carried another token's logprobs would show."""
    rng = random.Random(f"{rid}/{index}")
    top = [(rng.randrange(VOCAB), -rng.random() * 10) for _ in range(20)]
    return SampledToken(rid, top[0][0], TokenLogprobs(top[0][0], top[0][1], top))


def rank_main(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from pdserve.distributed.comm import GroupComm
    from pdserve.distributed.groups import init_tp
    from pdserve.distributed.trace import CollectiveTrace

    init_tp(rank, 2, port, timeout_s=60)
    trace = CollectiveTrace(keep=True)
    comm = GroupComm(rank, 2, dist.group.WORLD, plan_bytes=1 << 14, trace=trace)
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=SEQS, max_num_batched_tokens=256,
                                      max_model_len=64), BlockAllocator(4 * SEQS), frozenset({2}))

    def run_batch(batch, sample):
        trace.record("forward" if batch else "idle")
        return [token(s.request_id, len(s.output_ids)) for s, start, n in batch
                if sample and start + n == s.num_tokens]

    loop = LockstepLoop(sched, comm, run_batch, digest_every=3, trace=trace)
    requests = [NewRequest(f"seq-{i:03d}", [5, 6, 7], SamplingParams(temperature=0, max_tokens=OUTPUT,
                                                                      ignore_eos=True)) for i in range(SEQS)]
    reports = {}
    for step in range(50):
        plan, outputs = loop.step(Inbox(new=requests) if rank == 0 and step == 0 else Inbox())
        assert plan.error is None, plan.error
        for out in outputs:
            if out.token_id is not None:
                reports.setdefault(out.request_id, []).append((out.token_id, out.logprobs))
        if step > 0 and not sched.has_work():
            break
    sched.allocator.check_integrity()
    results.put((rank, trace.names, reports, sched.allocator.num_free))


def test_other_ranks_get_the_tokens_without_their_logprobs():
    out = run_ranks(rank_main, timeout=240)
    names, reports, free = out[0]
    assert out[1][0] == names  # the same collectives on both ranks
    assert names.count("broadcast") > OUTPUT and "broadcast-rest" not in names
    assert free == out[1][2] == 4 * SEQS
    assert len(reports) == SEQS
    for rid, tokens in reports.items():
        expected = [token(rid, i) for i in range(OUTPUT)]
        assert tokens == [(t.token_id, t.logprobs) for t in expected], rid
        assert out[1][1][rid] == [(t.token_id, None) for t in expected], rid
