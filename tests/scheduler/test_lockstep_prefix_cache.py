"""The prefix cache under lockstep: 3,000 steps over 2 real gloo ranks with requests that share
prefixes (colocated and prefill-role, so rooms are held while "sent"), random aborts, a pool
small enough to evict, mixed priorities (so that requests preempt each other), and rank-local
transfer outcomes. Every rank makes the same cache decisions (same hits, same evictions: the
"cache" field of the state digest) and the same preemptions, the divergence check never fires,
and once everything ends every block is back (cached or empty). Also with
a host-memory tier behind the device pool (evicted blocks saved there, hits loaded back)."""
from __future__ import annotations

import random

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import FinishReason, KVRole
from pdserve.kvcache import BlockAllocator, CacheTensorSpec, HostTier, KVPool, salt_of
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig
from pdserve.scheduler.lockstep import LockstepLoop, state_digest
from pdserve.scheduler.plan import SampledToken, TransferKind, TransferOutcome

from tests.scheduler.lockstep_ranks import RandomInbox, run_ranks

STEPS = 3_000
DRAIN = 200
BLOCKS = 40


class RandomWrites:
    """A prefill rank's agent: each room's write ends (written, or failed then fenced) at a
    random moment of this rank's own; an aborted room is fenced a little later."""

    def __init__(self, rank: int):
        self.rng = random.Random(2000 + rank)
        self.rooms: dict[str, str] = {}  # room → "open" | "aborted"

    def observe(self) -> list[TransferOutcome]:
        out = []
        for rid, state in list(self.rooms.items()):
            if state == "open" and self.rng.random() < 0.2:
                del self.rooms[rid]
                if self.rng.random() < 0.1:
                    out += [TransferOutcome(rid, TransferKind.FAILED, error="random"),
                            TransferOutcome(rid, TransferKind.FENCED)]
                else:
                    out.append(TransferOutcome(rid, TransferKind.WRITTEN))
            elif state == "aborted" and self.rng.random() < 0.3:
                del self.rooms[rid]
                out.append(TransferOutcome(rid, TransferKind.FENCED))
        return out

    def act(self, plan, outputs, held) -> None:
        stop = [rid for rid, _ in plan.aborted] + [t.request_id for t in plan.transfers
                                                   if t.kind is TransferKind.FAILED]
        for rid in stop:
            if self.rooms.get(rid) == "open":
                self.rooms[rid] = "aborted"
        for out in outputs:
            if out.finish_reason is FinishReason.KV_PENDING:
                self.rooms[out.request_id] = "open"


def rank_main(rank: int, port: int, results, host: bool) -> None:
    from pdserve.distributed.groups import init_tp
    from pdserve.distributed.trace import CollectiveTrace

    tp, comm = init_tp(rank, 2, port, timeout_s=60)
    comm.trace = CollectiveTrace(keep=True)
    tier = None
    if host:  # a real (tiny) pool, so evictions and loads move bytes
        import torch
        pool = KVPool([[CacheTensorSpec("k", (2,), torch.float32)]], BLOCKS, 4)
        tier = HostTier(pool, 24)
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=12, max_num_batched_tokens=48,
                                      max_model_len=128, cache_salt=salt_of("harness")),
                      BlockAllocator(BLOCKS, caching=True, host=tier), frozenset({2}))
    tokens = random.Random(7)  # rank 0 samples (the others' tokens are never used)
    displaced: list[str] = []  # rank 0's priority preemptions (the plan carries them to the others)
    plan_displace = sched._displace

    def counted(*args):
        victims = plan_displace(*args)
        displaced.extend(victims)
        return victims

    sched._displace = counted

    def run_batch(batch, sample):
        comm.trace.record("forward" if batch else "idle")
        return [SampledToken(s.request_id, tokens.randrange(3, 50)) for s, start, n in batch
                if sample and start + n == s.num_tokens]

    loop = LockstepLoop(sched, comm, run_batch, RandomWrites(rank), digest_every=25, trace=comm.trace)
    rng = random.Random(42)
    prefixes = [[rng.randrange(3, 50) for _ in range(n)] for n in (9, 16, 23)]

    def shared_prefix(rid: str, rng: random.Random) -> NewRequest:
        prompt = rng.choice(prefixes) + [rng.randrange(3, 50) for _ in range(rng.randint(1, 12))]
        kv = rng.choice([KVRole.LOCAL, KVRole.PREFILL])
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 10), priority=rng.choice([-1, 0, 0, 3]))
        return NewRequest(rid, prompt, params, kv=kv)

    inbox = RandomInbox(shared_prefix, STEPS, DRAIN, abort_p=0.2, rng=rng)  # rank 0's
    digests, errors = [], []
    for step in range(STEPS):
        plan, _ = loop.step(inbox.at(step) if rank == 0 else Inbox())
        if plan.error:
            errors.append(plan.error)
            break
        inbox.drop(rid for rid, _ in plan.rejected + plan.cancelled)
        sched.allocator.check_integrity()
        digests.append(state_digest(sched, ""))
    a = sched.allocator
    results.put((rank, errors, comm.trace.names, digests, a.num_free, a.num_used, a.num_hits,
                 a.num_evictions, sched.has_work(), tier.num_loaded if tier else 0, sched.num_preemptions,
                 len(displaced)))


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("host", [False, True], ids=["device", "with-host-tier"])
def test_cache_decisions_are_identical_on_every_rank(host):
    got = run_ranks(rank_main, host)
    (err0, trace0, dig0, free0, used0, hits0, ev0, work0, loads0, pre0, displaced) = got[0]
    (err1, trace1, dig1, free1, used1, hits1, ev1, work1, loads1, pre1, _) = got[1]
    assert err0 == err1 == []
    assert trace0 == trace1
    assert dig0 == dig1  # including the cache: holders, LRU order, index
    assert len({d["cache"] for d in dig0}) > 100  # the cache state did change along the way
    assert (free0, used0) == (free1, used1) == (BLOCKS, 0)
    assert hits0 == hits1 > 0 and ev0 == ev1 > 0  # shared prefixes were reused, blocks evicted
    assert not work0 and not work1
    assert loads0 == loads1 and (loads0 > 0) == host  # hits from host memory, on both ranks alike
    assert pre0 == pre1 >= displaced > 0  # mixed priorities preempted each other, alike on both ranks
