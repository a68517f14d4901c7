"""Scheduler: planning is pure, chunked prefill respects the budget, aborts work in every phase."""
from __future__ import annotations

import copy

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import FinishReason, KVRole
from pdserve.kvcache import BlockAllocator
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig
from pdserve.scheduler.plan import KVPeer, SampledToken, TransferKind, TransferOutcome


def make(num_blocks=16, budget=8, max_seqs=4) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=4, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     max_model_len=64), BlockAllocator(num_blocks), frozenset({2}))


def req(rid: str, n: int, max_tokens: int = 4) -> NewRequest:
    return NewRequest(rid, list(range(10, 10 + n)), SamplingParams(temperature=0, max_tokens=max_tokens))


def snapshot(s: Scheduler):
    return ([(q.request_id, q.num_computed, list(q.block_table), list(q.output_ids)) for q in s.waiting],
            [(q.request_id, q.num_computed, list(q.block_table), list(q.output_ids)) for q in s.running],
            s.allocator.num_free)


def test_plan_does_not_change_state():
    s = make()
    s.apply(s.plan(0, Inbox(new=[req("a", 6), req("b", 3)]), []))
    before = snapshot(s)
    s.plan(1, Inbox(new=[req("c", 5)], aborts=[("a", "abort")]), [SampledToken("b", 7)])
    assert snapshot(s) == before


def test_chunked_prefill_stays_within_the_token_budget():
    s = make(budget=8)
    plan = s.plan(0, Inbox(new=[req("a", 20), req("b", 5)]), [])
    assert sum(c.num_tokens for c in plan.batch) <= 8
    assert plan.batch[0].num_tokens == 8  # the first prompt is chunked
    outputs, batch = s.apply(plan)
    assert [(q.request_id, start, n) for q, start, n in batch] == [("a", 0, 8)]


def run_steps(s: Scheduler, n: int, first_step: int = 0) -> list[SampledToken]:
    """Apply n plans, feeding back a fixed token for every sequence that reached its end."""
    sampled: list[SampledToken] = []
    for i in range(n):
        _, batch = s.apply(s.plan(first_step + i, Inbox(), sampled))
        sampled = [SampledToken(q.request_id, 5) for q, start, n in batch if start + n == q.num_tokens]
    return sampled


@pytest.mark.parametrize("phase", ["waiting", "prefilling", "decoding"])
def test_abort_frees_blocks_in_every_phase(phase):
    s = make(budget=8, max_seqs=1 if phase == "waiting" else 4)
    s.apply(s.plan(0, Inbox(new=[req("busy", 4, max_tokens=50), req("a", 12)]), []))
    sampled = run_steps(s, {"waiting": 2, "prefilling": 0, "decoding": 3}[phase], first_step=1)
    a = s.seqs["a"]
    assert {"waiting": a.num_computed == 0, "prefilling": 0 < a.num_computed < 12,
            "decoding": a.output_ids != []}[phase], (phase, a)
    outputs, _ = s.apply(s.plan(10, Inbox(aborts=[("a", "abort"), ("nope", "abort")]), sampled))
    assert ("a", "abort") in [(o.request_id, o.finish_reason) for o in outputs]
    assert "a" not in s.seqs
    s.allocator.check_integrity()
    assert s.allocator.num_used == len(s.seqs["busy"].block_table)


def test_preemption_when_blocks_run_out():
    s = make(num_blocks=6, budget=32)
    plan = s.plan(0, Inbox(new=[req("a", 8, 40), req("b", 8, 40), req("c", 7, 40)]), [])
    _, batch = s.apply(plan)
    sampled = [SampledToken(q.request_id, 5) for q, start, n in batch if start + n == q.num_tokens]
    preempted = []
    for step in range(1, 30):
        plan = s.plan(step, Inbox(), sampled)
        preempted += plan.preempted
        _, batch = s.apply(plan)
        s.allocator.check_integrity()
        sampled = [SampledToken(q.request_id, 5) for q, start, n in batch if start + n == q.num_tokens]
    assert preempted  # 3 requests of up to 48 tokens cannot share 6 blocks of 4


def test_duplicate_and_oversized_requests_are_rejected():
    s = make(num_blocks=4)
    s.apply(s.plan(0, Inbox(new=[req("a", 3)]), []))
    plan = s.plan(1, Inbox(new=[req("a", 3), req("big", 40), NewRequest("empty", [], SamplingParams())]), [])
    assert [r for r, _ in plan.rejected] == ["a", "big", "empty"]
    outputs, _ = s.apply(plan)
    assert {o.request_id for o in outputs if o.finish_reason == "error"} == {"a", "big", "empty"}
    assert "a" in s.seqs  # the first request with that id is untouched


def test_a_request_aborted_in_its_own_inbox_ends_aborted_without_running():
    """Its abort came with it (the router's /abort can overtake its submit): no error, no
    blocks, nothing admitted."""
    s = make(num_blocks=4)
    plan = s.plan(0, Inbox(new=[req("a", 3), req("b", 3)], aborts=[("a", FinishReason.ABORT)]), [])
    assert plan.cancelled == [("a", FinishReason.ABORT)] and plan.rejected == []
    assert [r.request_id for r in plan.admitted] == ["b"]
    outputs, _ = s.apply(plan)
    assert [(o.request_id, o.finish_reason, o.error) for o in outputs if o.finish_reason] == \
        [("a", FinishReason.ABORT, None)]
    assert "a" not in s.seqs and s.allocator.num_used == 1


def test_plan_is_deterministic():
    s1 = make()
    s2 = copy.deepcopy(s1)
    inbox = Inbox(new=[req("a", 9), req("b", 2)])
    assert s1.plan(0, inbox, []) == s2.plan(0, inbox, [])


@pytest.mark.parametrize("ending", [TransferKind.ARRIVED, TransferKind.FENCED])
def test_an_aborted_decode_room_frees_its_blocks_when_its_kv_lands_late(ending):
    """The abort reaches a decode room before the agreed end of its transfer. With TP, a rank
    can report an arrival (polled before it saw the abort, then held back in its backlog) after
    the abort: that arrival, like a fence, is the room's last word and must free its blocks."""
    s = make(num_blocks=8)
    room = NewRequest("r", list(range(10, 19)), SamplingParams(temperature=0, max_tokens=4),
                      kv=KVRole.DECODE, peer=KVPeer("p"))
    s.apply(s.plan(0, Inbox(new=[room]), []))
    assert s.allocator.num_used == 3
    s.apply(s.plan(1, Inbox(aborts=[("r", "abort")]), []))
    assert s.allocator.num_used == 3  # held: the transfer may still write
    outcome = TransferOutcome("r", ending, SampledToken("r", 7) if ending is TransferKind.ARRIVED else None)
    plan = s.plan(2, Inbox(), [], [outcome])
    outputs, batch = s.apply(plan)
    assert outputs == [] and batch == [] and not s.has_work()
    assert s.allocator.num_used == 0
    s.allocator.check_integrity()


def preq(rid: str, n: int, priority: int, max_tokens: int = 4) -> NewRequest:
    return NewRequest(rid, list(range(10, 10 + n)), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                   priority=priority))


def run_to_end(s: Scheduler, *inboxes: Inbox, steps: int = 200,
               sampled: list[SampledToken] | None = None) -> tuple[list[str], list[str]]:
    """Step until nothing is left, step i draining `inboxes[i]` (`sampled`: the tokens of a step
    before); (request ids in the order they first ran, preempted ids)."""
    started, preempted, sampled = [], [], sampled or []
    for step in range(steps):
        plan = s.plan(step, inboxes[step] if step < len(inboxes) else Inbox(), sampled)
        started += [c.request_id for c in plan.batch if c.request_id not in started]
        preempted += plan.preempted
        _, batch = s.apply(plan)
        s.allocator.check_integrity()
        sampled = [SampledToken(q.request_id, 5) for q, start, n in batch if start + n == q.num_tokens]
        if not s.seqs:
            return started, preempted
    raise AssertionError("the requests did not end")


def test_waiting_requests_start_in_priority_order():
    """vLLM's priority: with room for one request at a time, the waiting one of the smallest
    priority starts first, in arrival order among equals."""
    s = make(budget=32, max_seqs=1)
    inbox = Inbox(new=[preq("low", 4, 5), preq("mid-1", 4, 1), preq("high", 4, -3), preq("mid-2", 4, 1)])
    started, _ = run_to_end(s, inbox)
    assert started == ["high", "mid-1", "mid-2", "low"]
    assert s.allocator.num_used == 0


@pytest.mark.parametrize("prioritized", [True, False])
def test_preemption_takes_the_newest_of_the_largest_priority(prioritized):
    """When blocks run out, the running request of the largest priority is preempted, though an
    older one; with equal priorities, the newest."""
    s = make(num_blocks=6, budget=32)
    older, newer = (preq("older", 8, 2, 12), preq("newer", 4, 0, 12)) if prioritized else \
        (req("older", 8, 12), req("newer", 4, 12))  # both fit at first, not as they grow
    started, preempted = run_to_end(s, Inbox(new=[older]), Inbox(new=[newer]))
    assert started == ["older", "newer"]
    assert preempted and set(preempted) == {"older" if prioritized else "newer"}


def steps_until(s: Scheduler, *inboxes: Inbox, sampled: list[SampledToken] | None = None,
                first_step: int = 0) -> tuple[list[tuple[list[str], list[str]]], list[SampledToken]]:
    """Apply one plan per inbox (`sampled`: the tokens of a step before); each step's (request
    ids in its batch, preempted), and the last step's tokens (for `run_to_end`)."""
    seen, sampled = [], sampled or []
    for step, inbox in enumerate(inboxes, first_step):
        plan = s.plan(step, inbox, sampled)
        seen.append(([c.request_id for c in plan.batch], list(plan.preempted)))
        _, batch = s.apply(plan)
        s.allocator.check_integrity()
        sampled = [SampledToken(q.request_id, 5) for q, start, n in batch if start + n == q.num_tokens]
    return seen, sampled


def test_a_smaller_priority_takes_the_slot_of_a_running_larger_one():
    """Priority preemption: with room for one running request, one of priority -1 preempts the
    running one of priority 5 in the step it arrives and runs in it; the preempted one runs
    again once it ends, and both finish."""
    s = make(budget=32, max_seqs=1)
    seen, sampled = steps_until(s, Inbox(new=[preq("low", 4, 5, max_tokens=20)]), Inbox(), Inbox(new=[preq("high", 4, -1)]))
    assert seen[2] == (["high"], ["low"])
    started, preempted = run_to_end(s, sampled=sampled)
    assert started == ["high", "low"] and preempted == []
    assert s.allocator.num_used == 0


def test_a_smaller_priority_takes_the_blocks_of_a_running_larger_one():
    """With slots to spare but too few blocks, the waiting request of the smaller priority
    preempts the running one whose blocks it needs."""
    s = make(num_blocks=8, budget=32)
    seen, sampled = steps_until(s, Inbox(new=[preq("low", 20, 5, max_tokens=8)]), Inbox(), Inbox(new=[preq("high", 12, 0)]))
    assert seen[2] == (["high"], ["low"])
    run_to_end(s, sampled=sampled)
    assert s.allocator.num_used == 0


@pytest.mark.parametrize("priorities", [(0, 0), (-1, -1), (2, 3)])
def test_an_equal_or_larger_priority_waits_for_the_running_one(priorities):
    """No preemption for a waiting request whose priority is not smaller: it waits (fcfs is
    this with every priority 0)."""
    running, arriving = priorities
    s = make(budget=32, max_seqs=1)
    seen, sampled = steps_until(s, Inbox(new=[preq("first", 4, running, max_tokens=6)]), Inbox(),
                       Inbox(new=[preq("second", 4, arriving)]), Inbox())
    assert seen[2:] == [(["first"], []), (["first"], [])]


def test_nothing_is_preempted_that_would_not_make_room():
    """A waiting request that would not fit even with every running request of a larger
    priority gone preempts none of them (a smaller-priority one holds the blocks)."""
    s = make(num_blocks=10, budget=32)
    seen, sampled = steps_until(s, Inbox(new=[preq("top", 20, -5, max_tokens=8), preq("low", 4, 5, max_tokens=8)]),
                       Inbox(), Inbox(new=[preq("high", 16, -1)]))
    assert seen[2] == (["top", "low"], [])
    started, preempted = run_to_end(s, sampled=sampled)
    assert "high" in started and "top" not in preempted
    assert s.allocator.num_used == 0


def test_the_newest_of_the_largest_priority_goes_first_and_a_burst_preempts_at_once():
    """Victims are taken as growth preemption takes them (the newest of the largest priority
    first); two waiting requests that each need a slot displace two running ones in one step."""
    s = make(budget=64, max_seqs=3)
    seen, sampled = steps_until(s, Inbox(new=[preq("l-old", 4, 5, 12), preq("mid", 4, 3, 12)]),
                       Inbox(new=[preq("l-new", 4, 5, 12)]),
                       Inbox(new=[preq("h1", 4, -1), preq("h2", 4, -1)]))
    assert seen[2] == (["mid", "h1", "h2"], ["l-new", "l-old"])
    started, preempted = run_to_end(s, sampled=sampled)
    assert s.allocator.num_used == 0




def land(s: Scheduler, rooms: list[NewRequest], step: int, sampled: list[SampledToken] | None = None
         ) -> tuple[list[str], list[SampledToken]]:
    """Admit decode rooms in `step` (their blocks taken; `sampled`: the step before's tokens),
    then report their KV landed, each with its first token (7), in the next step; that step's
    batch and its tokens. A room's first token goes out in the step it first runs."""
    _, sampled = steps_until(s, Inbox(new=rooms), sampled=sampled, first_step=step)
    arrived = [TransferOutcome(r.request_id, TransferKind.ARRIVED, SampledToken(r.request_id, 7)) for r in rooms]
    arrived_ids = {r.request_id for r in rooms}
    plan = s.plan(step + 1, Inbox(), sampled, arrived)
    outputs, batch = s.apply(plan)
    s.allocator.check_integrity()
    ran = [c.request_id for c in plan.batch]
    assert sorted(o.request_id for o in outputs if o.token_id == 7) == sorted(r for r in ran if r in arrived_ids)
    return ran, [SampledToken(q.request_id, 5) for q, start, n in batch if start + n == q.num_tokens]


def room(rid: str, priority: int = 0, max_tokens: int = 6) -> NewRequest:
    return NewRequest(rid, list(range(10, 15)), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                priority=priority),
                      kv=KVRole.DECODE, peer=KVPeer("p"))


def test_a_decode_worker_runs_at_most_max_num_seqs_landed_rooms():
    """Rooms whose KV landed past `max_num_seqs` keep it and wait for a slot: each step decodes
    the first two, in landing order; a room starts when one ends, and is reported waiting until
    then, its first token held back until that step. Every block comes back."""
    s = make(num_blocks=32, budget=32, max_seqs=2)
    batch, sampled = land(s, [room("a", max_tokens=3), room("b"), room("c"), room("d")], 0)
    assert batch == ["a", "b"]
    assert s.load() == (2, 2)
    assert s.allocator.num_used == 8  # every landed room keeps its KV
    firsts = []  # the steps in which each room's first token (7) went out
    for step in (2, 3):
        plan = s.plan(step, Inbox(), sampled)
        outputs, batch = s.apply(plan)
        firsts.append([o.request_id for o in outputs if o.token_id == 7])
        assert [c.request_id for c in plan.batch] == (["a", "b"] if step == 2 else ["b", "c"])  # "a" ended
        sampled = [SampledToken(q.request_id, 5) for q, start, n in batch if start + n == q.num_tokens]
    assert firsts == [[], ["c"]]  # "c" waited for its slot before its first token went out
    started, preempted = run_to_end(s, sampled=sampled)
    assert started == ["b", "c", "d"] and preempted == []
    assert s.allocator.num_used == 0 and s.load() == (0, 0)


def test_a_landed_room_of_a_smaller_priority_takes_a_decode_slot_first():
    """Past the bound, the running order is the priority order: a room of priority -1 that
    lands later decodes in the next step, and the newest room of priority 0 waits instead,
    keeping its KV (paused, not preempted)."""
    s = make(num_blocks=32, budget=32, max_seqs=2)
    _, sampled = land(s, [room("old", max_tokens=20), room("new", max_tokens=20)], 0)
    batch, _ = land(s, [room("urgent", priority=-1)], 2, sampled)
    assert batch == ["urgent", "old"]
    assert s.load() == (2, 1) and s.num_preemptions == 0


def test_a_decode_room_of_a_smaller_priority_takes_the_blocks_of_running_larger_ones():
    """A room that finds too few free blocks preempts running requests of a larger priority, the
    newest of the largest first, in the step it arrives, and only as many as let it fit; a room
    of an equal priority, or one that would not fit even with every larger one gone (seven
    blocks, where the two of priority 5 free four), waits and preempts nothing."""
    s = make(num_blocks=8, budget=32, max_seqs=4)
    _, sampled = land(s, [room("p5-old", priority=5, max_tokens=20), room("p3", priority=3, max_tokens=20),
                          room("p5-new", priority=5, max_tokens=20)], 0)
    assert s.allocator.num_free == 2  # each room holds two blocks of 4 tokens
    for rid, priority, tokens, expected in [("eq", 5, 9, None), ("big", 4, 28, None), ("urgent", -1, 9, ["p5-new"])]:
        plan = s.plan(2, Inbox(new=[NewRequest(rid, list(range(10, 10 + tokens)),
                                               SamplingParams(temperature=0, priority=priority),
                                               kv=KVRole.DECODE, peer=KVPeer("p"))]), sampled)
        if expected is None:
            assert [r.request_id for r in plan.deferred] == [rid] and plan.preempted == []
    assert plan.preempted == expected and [r.request_id for r in plan.admitted] == ["urgent"]
    assert "p5-new" not in [c.request_id for c in plan.batch]
    s.apply(plan)
    s.allocator.check_integrity()
    assert [q.request_id for q in s.waiting] == ["p5-new"] and "urgent" in s.held
    assert s.allocator.num_free == 1  # two free and two of p5-new's, less urgent's three
