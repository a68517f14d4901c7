"""10,000 lockstep steps over 2 real gloo ranks with random admissions, aborts and rank-local
transfer outcomes: every rank enters the same collectives in the same order and keeps the same
scheduler state at every step; once everything is aborted, every block is back in the pool.
The rooms' prompts share prefixes and the allocator caches, so rooms take blocks their worker
kept from earlier rooms (the plan's `room_hits`) while others are aborted or fail around them."""
from __future__ import annotations

import random

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import KVRole
from pdserve.kvcache import BlockAllocator
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig
from pdserve.scheduler.lockstep import LockstepLoop, state_digest
from pdserve.scheduler.plan import KVPeer, SampledToken, TransferKind, TransferOutcome

from tests.scheduler.lockstep_ranks import RandomInbox, run_ranks

STEPS = 10_000
DRAIN = 200  # the last steps abort what is live and admit nothing


class RandomTransfers:
    """A rank-local transfer agent whose rooms land, fail or fence at random moments.

    As with the real agent, a room can land here and be reported steps later (a busy rank's
    backlog): an abort in between finds it complete, so it changes nothing and no fence follows.
    """

    def __init__(self, rank: int):
        self.rng = random.Random(1000 + rank)  # each rank its own randomness
        self.rooms: dict[str, str] = {}  # room → "open" | "landed" | "aborted"

    def observe(self) -> list[TransferOutcome]:
        out = []
        for rid, state in list(self.rooms.items()):
            if state == "open" and self.rng.random() < 0.2:
                if self.rng.random() < 0.1:
                    del self.rooms[rid]
                    out += [TransferOutcome(rid, TransferKind.FAILED, error="random"),
                            TransferOutcome(rid, TransferKind.FENCED)]
                else:
                    self.rooms[rid] = "landed"
            elif state == "landed" and self.rng.random() < 0.5:
                del self.rooms[rid]
                out.append(TransferOutcome(rid, TransferKind.ARRIVED, SampledToken(rid, 7)))
            elif state == "aborted" and self.rng.random() < 0.3:
                del self.rooms[rid]
                out.append(TransferOutcome(rid, TransferKind.FENCED))
        return out

    def act(self, plan, outputs, held) -> None:
        stop = [rid for rid, _ in plan.aborted] + [t.request_id for t in plan.transfers if t.kind is TransferKind.FAILED]
        for rid in stop:
            if self.rooms.get(rid) == "open":
                self.rooms[rid] = "aborted"
        for req in plan.admitted:
            self.rooms[req.request_id] = "open"


def decode_request(rid: str, rng: random.Random) -> NewRequest:
    """A decode room of 1-30 prompt tokens and up to 12 output tokens."""
    return NewRequest(rid, [5] * rng.randint(1, 30), SamplingParams(temperature=0, max_tokens=rng.randint(1, 12)),
                      kv=KVRole.DECODE, peer=KVPeer("p"))


def rank_main(rank: int, port: int, results) -> None:
    from pdserve.distributed.groups import init_tp

    tp, comm = init_tp(rank, 2, port, timeout_s=60)
    from pdserve.distributed.trace import CollectiveTrace
    comm.trace = CollectiveTrace(keep=True)
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=16, max_num_batched_tokens=64,
                                      max_model_len=256), BlockAllocator(48, caching=True), frozenset({2}))
    tokens = random.Random(7)

    def run_batch(batch, sample):
        comm.trace.record("forward" if batch else "idle")
        return [SampledToken(s.request_id, tokens.randrange(3, 50)) for s, start, n in batch
                if sample and start + n == s.num_tokens]

    loop = LockstepLoop(sched, comm, run_batch, RandomTransfers(rank), digest_every=50, trace=comm.trace)
    inbox = RandomInbox(decode_request, STEPS, DRAIN, abort_p=0.3)  # rank 0's
    digests, room_hits = [], 0
    for step in range(STEPS):
        plan, _ = loop.step(inbox.at(step) if rank == 0 else Inbox())
        room_hits += len(plan.room_hits)
        inbox.drop(r.request_id for r in plan.deferred)  # the engine would queue them again
        assert plan.error is None, plan.error
        sched.allocator.check_integrity()
        digests.append(state_digest(sched, ""))
    assert not sched.has_work(), (list(sched.seqs), list(sched.held))  # every request and room ended
    results.put((rank, comm.trace.names, digests, sched.allocator.num_free, room_hits))


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_ten_thousand_steps_keep_ranks_identical():
    got = run_ranks(rank_main)
    (trace0, dig0, free0, hits0), (trace1, dig1, free1, hits1) = got[0], got[1]
    assert len(trace0) >= 3 * STEPS
    assert trace0 == trace1  # the same collectives, in the same order
    assert dig0 == dig1      # the same state after every step
    assert free0 == free1 == 48  # every block came back (empty, or cached and held by none)
    assert hits0 == hits1 > 1000, hits0  # rooms took cached blocks, the same on both ranks
    assert any(name == "forward" for name in trace0) and any(name == "idle" for name in trace0)
