"""A burst of transfer outcomes over 2 real gloo ranks: 80 decode rooms land in the same step,
each first token with 20 top logprobs (≈ 480 bytes pickled). Rank 0's observation would need
≈ 38 KB, past its 16 KiB buffer: the loop reports them over several steps instead (bounded by
bytes as well as by count), every room gets its own first token and logprobs, and every rank
enters the same collectives and ends with a full pool."""
from __future__ import annotations

import random

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import KVRole, TokenLogprobs
from pdserve.kvcache import BlockAllocator
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig
from pdserve.scheduler.lockstep import LockstepLoop
from pdserve.scheduler.plan import KVPeer, SampledToken, TransferKind, TransferOutcome

from tests.scheduler.lockstep_ranks import run_ranks

ROOMS = 80
VOCAB = 129_280  # DeepSeek's: ids past 65,535 pickle to 5 bytes


def first_token(rid: str) -> SampledToken:
    """Room `rid`'s first token, as the prefill worker sent it, with 20 top logprobs."""
    rng = random.Random(rid)
    top = [(rng.randrange(VOCAB), -rng.random() * 10) for _ in range(20)]
    return SampledToken(rid, top[0][0], TokenLogprobs(top[0][0], top[0][1], top))


class BurstLink:
    """Every room admitted so far lands at once, on every rank, once all of them are admitted."""

    def __init__(self, rank: int) -> None:
        self.rank, self.open, self.landed = rank, [], False

    def observe(self) -> list[TransferOutcome]:
        if self.landed or len(self.open) < ROOMS:
            return []
        self.landed = True
        return [TransferOutcome(rid, TransferKind.ARRIVED, first_token(rid) if self.rank == 0 else None)
                for rid in self.open]

    def act(self, plan, outputs, held) -> None:
        self.open += [req.request_id for req in plan.admitted]


def rank_main(rank: int, port: int, results) -> None:
    from pdserve.distributed.groups import init_tp
    from pdserve.distributed.trace import CollectiveTrace

    _, comm = init_tp(rank, 2, port, timeout_s=60)
    comm.trace = CollectiveTrace(keep=True)
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=ROOMS, max_num_batched_tokens=256,
                                      max_model_len=64), BlockAllocator(4 * ROOMS), frozenset({2}))

    def run_batch(batch, sample):
        comm.trace.record("forward" if batch else "idle")
        return [SampledToken(s.request_id, 9) for s, start, n in batch if sample and start + n == s.num_tokens]

    loop = LockstepLoop(sched, comm, run_batch, BurstLink(rank), digest_every=5, trace=comm.trace)
    rooms = [NewRequest(f"room-{i:03d}-{'x' * 40}", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2),
                        kv=KVRole.DECODE, peer=KVPeer("p")) for i in range(ROOMS)]
    firsts, reported = {}, []
    for step in range(400):
        inbox = Inbox(new=rooms) if rank == 0 and step == 0 else Inbox()
        plan, outputs = loop.step(inbox)
        assert plan.error is None, plan.error
        reported.append(sum(t.kind is TransferKind.ARRIVED for t in plan.transfers))
        for out in outputs:
            if out.token_id is not None and out.request_id not in firsts:
                firsts[out.request_id] = (out.token_id, out.logprobs)
        if step > 0 and not sched.has_work():
            break
    sched.allocator.check_integrity()
    results.put((rank, comm.trace.names, firsts, reported, sched.allocator.num_free))


def test_a_burst_of_landed_rooms_with_top_logprobs_is_agreed_over_several_steps():
    out = run_ranks(rank_main, timeout=240)
    names, firsts, reported, free = out[0]
    assert out[1][0] == names  # the same collectives on both ranks
    assert free == out[1][3] == 4 * ROOMS
    assert sum(reported) == ROOMS and max(reported) < ROOMS  # all of them, over more than one step
    expected = {rid: first_token(rid) for rid in firsts}
    assert len(firsts) == ROOMS
    for rid, (token, logprobs) in firsts.items():
        assert token == expected[rid].token_id and logprobs == expected[rid].logprobs, rid
        assert out[1][1][rid] == (token, None), rid  # rank 1 gets the token without its logprobs
