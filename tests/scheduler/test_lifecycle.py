"""The held-request lifecycle: one table decides every move, and plan() frees what apply() frees."""
from __future__ import annotations

import itertools

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import FinishReason, KVRole, SequenceStatus
from pdserve.kvcache import BlockAllocator
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig
from pdserve.scheduler.lifecycle import HeldEvent, step
from pdserve.scheduler.lockstep import Observation, TransferAgreement
from pdserve.scheduler.plan import KVPeer, SampledToken, TransferKind, TransferOutcome

S = SequenceStatus
HELD = [S.AWAITING_KV, S.SENDING, S.DRAINING]


def test_only_an_arrival_runs_a_held_request():
    for status, event in itertools.product(HELD, HeldEvent):
        ran = step(status, event).status is S.RUNNING
        assert ran == (status is S.AWAITING_KV and event is HeldEvent.ARRIVED), (status, event)


def test_blocks_come_back_only_on_a_transfers_last_word():
    for status, event in itertools.product(HELD, HeldEvent):
        if step(status, event).frees_blocks:
            assert event in (HeldEvent.ARRIVED, HeldEvent.WRITTEN, HeldEvent.FENCED), (status, event)
    assert not step(S.AWAITING_KV, HeldEvent.ABORT).frees_blocks  # a write may be in flight
    assert not step(S.SENDING, HeldEvent.FAILED).frees_blocks


def test_a_held_request_reports_its_end_once():
    assert step(S.AWAITING_KV, HeldEvent.FAILED) == (S.DRAINING, FinishReason.ERROR)
    assert step(S.SENDING, HeldEvent.WRITTEN) == (S.FINISHED, FinishReason.PREFILLED)
    assert step(S.SENDING, HeldEvent.ABORT) == (S.DRAINING, FinishReason.ABORT)
    for event in HeldEvent:  # a draining request already reported its end
        assert step(S.DRAINING, event).finish is None


def test_a_request_that_is_not_held_does_not_move():
    for status, event in itertools.product([S.WAITING, S.RUNNING, S.FINISHED], HeldEvent):
        assert step(status, event) == (status, None)


def decode_room(rid: str, n: int) -> NewRequest:
    return NewRequest(rid, list(range(10, 10 + n)), SamplingParams(temperature=0, max_tokens=4),
                      kv=KVRole.DECODE, peer=KVPeer("p"))


def test_plan_counts_the_blocks_of_a_room_that_lands_and_is_aborted_in_one_step():
    """The arrival runs the request, the abort then ends it: its 3 blocks come back in the
    step, so a room that needs them is admitted in the same step, not deferred."""
    s = Scheduler(SchedulerConfig(block_size=4, max_model_len=64), BlockAllocator(6))
    s.apply(s.plan(0, Inbox(new=[decode_room("r", 12)]), []))
    s.apply(s.plan(1, Inbox(new=[decode_room("other", 12)]), []))
    assert s.allocator.num_free == 0
    landed = TransferOutcome("r", TransferKind.ARRIVED, SampledToken("r", 7))
    plan = s.plan(2, Inbox(new=[decode_room("next", 12)], aborts=[("r", FinishReason.ABORT)]), [], [landed])
    assert [r.request_id for r in plan.admitted] == ["next"] and plan.deferred == []
    outputs, _ = s.apply(plan)
    assert [(o.request_id, o.token_id, o.finish_reason) for o in outputs if o.room_blocks is None] == [
        ("r", 7, None), ("r", None, FinishReason.ABORT)]
    assert s.held["next"].status is S.AWAITING_KV and s.allocator.num_free == 0
    s.allocator.check_integrity()


@pytest.mark.parametrize("kind", [TransferKind.FAILED, TransferKind.WRITTEN])
def test_a_sending_prefill_request_ends_by_the_table(kind):
    s = Scheduler(SchedulerConfig(block_size=4, max_model_len=64), BlockAllocator(8))
    req = NewRequest("p", list(range(10, 19)), SamplingParams(temperature=0), kv=KVRole.PREFILL,
                     peer=KVPeer("d", ("boot",), (0, 1, 2)))
    _, batch = s.apply(s.plan(0, Inbox(new=[req]), []))
    outputs, _ = s.apply(s.plan(1, Inbox(), [SampledToken("p", 5)]))
    assert [(o.token_id, o.finish_reason) for o in outputs] == [(5, FinishReason.KV_PENDING)]
    assert s.held["p"].status is S.SENDING and s.allocator.num_used == 3
    outputs, _ = s.apply(s.plan(2, Inbox(), [], [TransferOutcome("p", kind, error="x")]))
    want = FinishReason.ERROR if kind is TransferKind.FAILED else FinishReason.PREFILLED
    assert [o.finish_reason for o in outputs] == [want]
    assert s.allocator.num_used == (3 if kind is TransferKind.FAILED else 0)  # failed: wait for the fence
    if kind is TransferKind.FAILED:
        s.apply(s.plan(3, Inbox(), [], [TransferOutcome("p", TransferKind.FENCED)]))
    assert s.allocator.num_used == 0 and not s.has_work()


@pytest.mark.parametrize("peer_dead", [False, True])
def test_a_transfer_that_failed_because_the_peer_died_says_so_in_its_output(peer_dead):
    """The /prefill call answers by this flag: the decode worker gone (the router's 503), or a
    failure of the prefill itself (500)."""
    s = Scheduler(SchedulerConfig(block_size=4, max_model_len=64), BlockAllocator(8))
    req = NewRequest("p", list(range(10, 19)), SamplingParams(temperature=0), kv=KVRole.PREFILL,
                     peer=KVPeer("d", ("boot",), (0, 1, 2)))
    s.apply(s.plan(0, Inbox(new=[req]), []))
    s.apply(s.plan(1, Inbox(), [SampledToken("p", 5)]))
    failed = TransferOutcome("p", TransferKind.FAILED, error="target gone", peer_dead=peer_dead)
    outputs, _ = s.apply(s.plan(2, Inbox(), [], [failed]))
    assert [(o.finish_reason, o.peer_dead) for o in outputs] == [(FinishReason.ERROR, peer_dead)]
    assert outputs[0].error == "KV transfer failed: target gone"


def test_the_ranks_agree_on_why_a_room_failed():
    agree = TransferAgreement(2)
    assert agree.add([Observation(0, [TransferOutcome("r", TransferKind.WRITTEN)])]) == []
    out = agree.add([Observation(1, [TransferOutcome("r", TransferKind.FAILED, error="x", peer_dead=True)])])
    assert out == [TransferOutcome("r", TransferKind.FAILED, error="rank 1: x", peer_dead=True)]


def test_a_room_the_other_worker_aborted_ends_as_aborted_not_failed():
    """Its client left the other worker: here too the request is aborted (no `error` finish, no
    failure count), and its blocks wait for the room's fence as after any failure."""
    s = Scheduler(SchedulerConfig(block_size=4, max_model_len=64), BlockAllocator(8))
    req = NewRequest("p", list(range(10, 19)), SamplingParams(temperature=0), kv=KVRole.PREFILL,
                     peer=KVPeer("d", ("boot",), (0, 1, 2)))
    s.apply(s.plan(0, Inbox(new=[req]), []))
    s.apply(s.plan(1, Inbox(), [SampledToken("p", 5)]))
    aborted = TransferOutcome("p", TransferKind.FAILED, error="rank 0: the other worker aborted the room",
                              aborted=True)
    outputs, _ = s.apply(s.plan(2, Inbox(), [], [aborted]))
    assert [(o.finish_reason, o.error) for o in outputs] == [
        (FinishReason.ABORT, "rank 0: the other worker aborted the room")]
    assert s.allocator.num_used == 3  # a write may still be in flight
    s.apply(s.plan(3, Inbox(), [], [TransferOutcome("p", TransferKind.FENCED)]))
    assert s.allocator.num_used == 0 and not s.has_work()


def test_the_ranks_agree_that_the_other_worker_aborted_a_room_from_the_first_failure():
    agree = TransferAgreement(2)
    first = agree.add([Observation(0, [TransferOutcome("r", TransferKind.FAILED, error="gone", aborted=True)]),
                       Observation(1, [TransferOutcome("r", TransferKind.FAILED, error="io")])])
    assert first == [TransferOutcome("r", TransferKind.FAILED, error="rank 0: gone", aborted=True)]
    agree = TransferAgreement(2)
    first = agree.add([Observation(0, [TransferOutcome("r", TransferKind.FAILED, error="io")]),
                       Observation(1, [TransferOutcome("r", TransferKind.FAILED, error="gone", aborted=True)])])
    assert first == [TransferOutcome("r", TransferKind.FAILED, error="rank 0: io")]
