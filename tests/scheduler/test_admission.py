"""Admission and preemption (issue 18): a request is admitted only when its whole prompt's
blocks are free with one block of growth per running stream left over; running streams that
need blocks preempt the most recently admitted first; a request alone in the running batch is
never preempted; the prefix cache's cached blocks count as free for all of this."""
from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import FinishReason, KVRole
from pdserve.kvcache import BlockAllocator, block_hashes
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig
from pdserve.scheduler.plan import KVPeer, SampledToken, TransferKind, TransferOutcome


def make(num_blocks: int, caching: bool = False) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                     BlockAllocator(num_blocks, caching=caching), frozenset({2}))


def req(rid: str, n: int, max_tokens: int = 40, start: int = 10) -> NewRequest:
    return NewRequest(rid, list(range(start, start + n)), SamplingParams(temperature=0, max_tokens=max_tokens))


class Driver:
    """Steps a scheduler, feeding back token 5 for every sequence that reached its end."""

    def __init__(self, s: Scheduler):
        self.s, self.step_no, self.sampled, self.preempted = s, 0, [], []

    def step(self, inbox: Inbox | None = None, transfers=()):
        plan = self.s.plan(self.step_no, inbox or Inbox(), self.sampled, list(transfers))
        self.preempted += plan.preempted
        _, batch = self.s.apply(plan)
        self.s.allocator.check_integrity()
        self.sampled = [SampledToken(q.request_id, 5) for q, start, n in batch if start + n == q.num_tokens]
        self.step_no += 1
        return plan


def test_a_request_alone_is_never_preempted_it_waits_for_held_blocks():
    s = make(6)
    d = Driver(s)
    room = NewRequest("room", list(range(10, 19)), SamplingParams(temperature=0, max_tokens=4),
                      kv=KVRole.DECODE, peer=KVPeer("p"))
    d.step(Inbox(new=[room]))  # 3 blocks held by a room whose KV has not landed
    d.step(Inbox(new=[req("a", 8, max_tokens=14)]))  # 21 tokens computed at most: 6 blocks
    for _ in range(20):
        d.step()
    a = s.seqs["a"]
    assert d.preempted == [] and a.num_computed == 12 and len(a.block_table) == 3  # stalled, not preempted
    d.step(transfers=[TransferOutcome("room", TransferKind.FAILED, error="x"),
                      TransferOutcome("room", TransferKind.FENCED)])
    for _ in range(30):
        d.step()
    assert "a" not in s.seqs and d.preempted == [] and s.allocator.num_used == 0


def test_admission_leaves_a_reserve_and_never_preempts_running_streams():
    s = make(8)
    d = Driver(s)
    d.step(Inbox(new=[req("s", 4, max_tokens=10)]))  # a running stream: 2 blocks soon
    d.step()
    plan = d.step(Inbox(new=[req("big", 20, max_tokens=4, start=100)]))  # 6 blocks + 1 reserve > 6 free
    assert [c.request_id for c in plan.batch] == ["s"]
    while "s" in s.seqs:
        d.step()
    assert d.preempted == []
    plan = d.step()
    assert [c.request_id for c in plan.batch] == ["big"]  # admitted once the stream is done


def test_running_streams_preempt_the_most_recently_admitted_first():
    s = make(8)
    d = Driver(s)
    d.step(Inbox(new=[req("old", 5, max_tokens=30)]))
    d.step(Inbox(new=[req("mid", 5, max_tokens=30, start=50)]))
    d.step(Inbox(new=[req("new", 5, max_tokens=30, start=90)]))
    while not d.preempted:
        d.step()
    assert d.preempted[0] == "new"
    assert s.num_preemptions == len(d.preempted)


def test_cached_blocks_count_as_free_and_a_hit_is_planned_and_applied():
    s = make(8, caching=True)
    d = Driver(s)
    d.step(Inbox(new=[req("a", 13, max_tokens=1)]))
    while s.has_work():
        d.step()
    # the prompt's 3 full blocks and its last token's block, kept as a tail
    assert s.allocator.num_free == 8 and s.allocator.num_cached == 4
    plan = d.step(Inbox(new=[req("b", 13, max_tokens=1)]))
    assert [(c.request_id, c.cached, c.num_tokens) for c in plan.batch] == [("b", 12, 1)]
    b = s.seqs["b"]
    assert b.cached_tokens == 12 and b.num_computed == 13 and s.allocator.num_used == 4


def test_a_tail_gives_the_tokens_after_the_last_full_block_to_one_request():
    """A finished request's partly filled last block is kept (a tail): a request that continues
    its tokens takes it whole (cached tokens past the full blocks) and writes after them; a
    second request planned in the same step cannot take it too and computes those tokens."""
    s = make(12, caching=True)
    d = Driver(s)
    d.step(Inbox(new=[req("a", 14, max_tokens=1)]))  # 3 full blocks, then 2 tokens in the 4th
    while s.has_work():
        d.step()
    parent = block_hashes(list(range(10, 22)), 4, s.config.cache_salt)[-1]
    tail = s.allocator.find_tail(parent, [22, 23, 99])
    assert tail[1] == 2 and s.allocator.refcount(tail[0]) == 0
    longer = list(range(10, 24)) + [70, 71, 72]
    plan = d.step(Inbox(new=[NewRequest("b", longer, SamplingParams(temperature=0, max_tokens=1)),
                             NewRequest("c", longer, SamplingParams(temperature=0, max_tokens=1))]))
    assert [(c.request_id, c.cached, c.num_tokens) for c in plan.batch] == [("b", 14, 3), ("c", 12, 5)]
    b, c = s.seqs["b"], s.seqs["c"]
    assert b.block_table[3] == tail[0] and s.allocator.refcount(tail[0]) == 1  # b alone holds it
    assert c.block_table[:3] == b.block_table[:3] and c.block_table[3] != tail[0]
    assert s.allocator.find_tail(parent, [22, 23]) == (-1, 0)  # taken: no longer cached


def room(rid: str, prompt: list[int], max_tokens: int = 3) -> NewRequest:
    return NewRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), kv=KVRole.DECODE,
                      peer=KVPeer("p"))


def test_a_decode_room_holds_the_blocks_its_worker_kept_and_asks_only_for_the_rest():
    """A decode worker's cache serves its rooms: a room whose prompt starts with blocks the
    worker holds takes them (the plan says how many, `StepPlan.room_hits`) and offers the
    prefill worker only fresh blocks for the rest. Every room's cached blocks are held before
    any room's blocks are allocated: here the second room's allocation would otherwise evict
    the first's (the least recently used). An aborted room leaves the cache as it found it."""
    s = make(7, caching=True)
    d = Driver(s)
    kept = list(range(10, 22))  # 3 full blocks
    for rid, prompt in (("kept", kept), ("newer", list(range(100, 112)))):
        d.step(Inbox(new=[NewRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=1))]))
        while s.has_work():
            d.step()
    held_before = s.allocator.lookup(block_hashes(kept, 4, b""))
    assert len(held_before) == 3 and s.allocator.num_cached == 6 and s.allocator.num_empty == 1

    plan = d.step(Inbox(new=[room("other", list(range(200, 212))), room("turn", kept + [7])]))
    assert [r.request_id for r in plan.admitted] == ["other", "turn"] and plan.room_hits == {"turn": 3}
    turn, other = s.seqs["turn"].block_table, s.seqs["other"].block_table
    assert turn[:3] == held_before and len(turn) == 4 and len(other) == 3 and not set(other) & set(turn)
    assert not any(s.allocator.is_cached(b) for b in other + turn[3:])

    # the KV of "turn" lands: it decodes from its prompt's end; "other" is aborted before its KV
    d.step(Inbox(aborts=[("other", FinishReason.ABORT)]),
           transfers=[TransferOutcome("turn", TransferKind.ARRIVED, SampledToken("turn", 5))])
    d.step(transfers=[TransferOutcome("other", TransferKind.FENCED)])
    while s.has_work():
        d.step()
    assert s.allocator.num_used == 0
    assert s.allocator.lookup(block_hashes(kept, 4, b"")) == held_before  # still cached, never written
    assert not any(s.allocator.is_cached(b) for b in other)  # its blocks never held KV
