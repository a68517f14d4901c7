"""The room state machine and table: named behaviours of kv-transfer.md, then properties."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.transfer.rooms import Outcome, Release, RoomEvent, RoomState, RoomTable, step

E, S = RoomEvent, RoomState
pytestmark = pytest.mark.timeout(60)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def table(**kw: float) -> tuple[RoomTable, FakeClock]:
    clock = FakeClock()
    return RoomTable(clock, **kw), clock


# ---- step: the machine itself ---------------------------------------------------------------
def test_happy_path_on_the_prefill_side() -> None:
    s = S.NEW
    for event, expected in [(E.ALLOCATE, S.ALLOCATED), (E.START, S.TRANSFERRING),
                            (E.COMPLETE, S.DONE)]:
        s, outcome = step(s, event)
        assert (s, outcome) == (expected, Outcome.APPLIED)


def test_decode_side_completes_without_seeing_the_start() -> None:
    assert step(S.ALLOCATED, E.COMPLETE) == (S.DONE, Outcome.APPLIED)


def test_illegal_moves_leave_the_state_unchanged() -> None:
    assert step(S.NEW, E.START) == (S.NEW, Outcome.ILLEGAL)
    assert step(S.NEW, E.COMPLETE) == (S.NEW, Outcome.ILLEGAL)
    assert step(S.ALLOCATED, E.ALLOCATE) == (S.ALLOCATED, Outcome.ILLEGAL)
    assert step(S.TRANSFERRING, E.START) == (S.TRANSFERRING, Outcome.ILLEGAL)


def test_terminal_states_are_sticky() -> None:
    for terminal in (S.DONE, S.FAILED, S.ABORTED):
        for event in E:
            assert step(terminal, event).state is terminal


# ---- the table: named behaviours ------------------------------------------------------------
def test_abort_twice_is_a_noop_the_second_time() -> None:
    t, _ = table()
    t.apply("r", E.ALLOCATE)
    assert t.abort("r") is Outcome.APPLIED
    assert t.abort("r") is Outcome.NOOP
    assert t.state("r") is S.ABORTED
    assert t.counters["rooms_aborted"] == 1 and t.counters["abort_repeated"] == 1


def test_abort_unknown_room_leaves_a_tombstone() -> None:
    t, _ = table()
    assert t.abort("ghost") is Outcome.APPLIED
    assert t.state("ghost") is S.ABORTED
    assert t.take_releases() == []  # it never had blocks: nothing to release


def test_add_after_abort_is_refused_and_counted() -> None:
    t, _ = table()
    t.abort("r")
    assert t.apply("r", E.ALLOCATE) is Outcome.REFUSED
    assert t.state("r") is S.ABORTED
    assert t.counters["allocate_refused"] == 1


def test_abort_after_done_or_failed_is_a_noop() -> None:
    t, _ = table()
    t.apply("d", E.ALLOCATE)
    t.apply("d", E.COMPLETE)
    t.apply("f", E.ALLOCATE)
    t.apply("f", E.FAIL, reason="boom")
    assert t.abort("d") is Outcome.NOOP and t.state("d") is S.DONE
    assert t.abort("f") is Outcome.NOOP and t.state("f") is S.FAILED
    assert t.get("f").reason == "boom"
    assert t.counters["rooms_aborted"] == 0


def test_late_notification_for_an_aborted_room_is_dropped_and_counted() -> None:
    t, _ = table()
    t.apply("r", E.ALLOCATE)
    t.abort("r")
    assert t.apply("r", E.COMPLETE) is Outcome.LATE
    assert t.apply("r", E.FAIL) is Outcome.LATE
    assert t.state("r") is S.ABORTED
    assert t.counters["late_complete"] == 1 and t.counters["late_fail"] == 1


def test_unknown_room_messages_are_counted_not_raised() -> None:
    t, _ = table()
    assert t.apply("x", E.COMPLETE) is Outcome.ILLEGAL
    assert t.fence("x", "sender fence") is False
    assert "x" not in t
    assert t.counters["unknown_complete"] == 1 and t.counters["fence_unknown"] == 1


def test_aborted_blocks_are_released_only_after_the_fence() -> None:
    t, _ = table()
    t.apply("r", E.ALLOCATE)
    t.apply("r", E.START)
    t.abort("r")
    assert not t.get("r").releasable and t.take_releases() == []
    t.fence("r", "write drained")
    assert t.get("r").releasable
    assert t.take_releases() == [Release("r", "write drained")]
    t.fence("r", "again")
    assert t.take_releases() == []  # reported once


def test_fence_before_the_abort_is_latched() -> None:
    t, _ = table()
    t.apply("r", E.ALLOCATE)
    t.fence("r", "sender fence")  # the fence overtook the abort
    assert t.take_releases() == []  # still live: its blocks are in use
    t.abort("r")
    assert t.take_releases() == [Release("r", "sender fence")]


def test_done_rooms_need_no_fence_and_report_no_release() -> None:
    t, _ = table()
    t.apply("r", E.ALLOCATE)
    t.apply("r", E.COMPLETE)
    assert t.get("r").releasable and t.take_releases() == []


def test_peer_death_fails_live_rooms_and_fences_its_rooms() -> None:
    t, _ = table()
    for room in ("a", "b", "c"):
        t.apply(room, E.ALLOCATE, peer="p")
    t.apply("z", E.ALLOCATE, peer="q")
    t.abort("b")
    t.apply("c", E.COMPLETE)
    assert sorted(t.peer_dead("p", "killed")) == ["a"]
    assert t.state("a") is S.FAILED and t.state("z") is S.ALLOCATED
    assert sorted(r.room for r in t.take_releases()) == ["a", "b"]


def test_fence_lease_expires() -> None:
    t, clock = table(fence_lease_s=5.0)
    t.apply("r", E.ALLOCATE)
    t.abort("r")
    clock.now += 4.9
    t.tick()
    assert t.take_releases() == []
    clock.now += 0.2
    t.tick()
    assert t.take_releases() == [Release("r", "fence lease expired")]


def test_room_lease_fails_a_live_room() -> None:
    t, clock = table(room_lease_s=10.0, fence_lease_s=0.0)
    t.apply("r", E.ALLOCATE)
    clock.now += 10.0
    assert t.tick() == ["r"]
    assert t.state("r") is S.FAILED and t.get("r").reason == "room lease expired"
    assert t.take_releases() == [Release("r", "fence lease expired")]


def test_tombstones_are_sticky_until_their_ttl() -> None:
    t, clock = table(tombstone_ttl_s=60.0)
    t.abort("r")
    clock.now += 59.0
    t.tick()
    assert t.apply("r", E.ALLOCATE) is Outcome.REFUSED
    clock.now += 2.0
    t.tick()
    assert "r" not in t and t.counters["tombstones_expired"] == 1


def test_unfenced_rooms_outlive_their_ttl_until_fenced() -> None:
    t, clock = table(tombstone_ttl_s=1.0, fence_lease_s=100.0)
    t.apply("r", E.ALLOCATE)
    t.abort("r")
    clock.now += 50.0
    t.tick()
    assert "r" in t  # its blocks are still held: the record must stay
    t.fence("r", "sender fence")
    t.tick()
    assert "r" not in t


def test_metrics_are_a_flat_dict_of_ints() -> None:
    t, _ = table()
    t.apply("r", E.ALLOCATE)
    t.abort("r")
    t.abort("r")
    m = t.metrics()
    assert m["rooms_aborted"] == 1 and m["abort_repeated"] == 1 and m["rooms_unfenced"] == 1
    assert all(isinstance(v, int) for v in m.values())


# ---- properties -----------------------------------------------------------------------------
ROOMS = ["r0", "r1", "r2"]
ops = st.lists(st.one_of(
    st.tuples(st.just("event"), st.sampled_from(ROOMS), st.sampled_from(list(E))),
    st.tuples(st.just("abort"), st.sampled_from(ROOMS)),
    st.tuples(st.just("fence"), st.sampled_from(ROOMS)),
    st.tuples(st.just("peer_dead"), st.sampled_from(["p", "q"])),
    st.tuples(st.just("tick"), st.floats(0.0, 20.0)),
), max_size=60)


def _run(t: RoomTable, clock: FakeClock, op: tuple) -> None:
    kind = op[0]
    if kind == "event":
        peer = "p" if op[1] != "r2" else "q"
        t.apply(op[1], op[2], peer=peer)
    elif kind == "abort":
        t.abort(op[1])
    elif kind == "fence":
        t.fence(op[1], "sender fence")
    elif kind == "peer_dead":
        t.peer_dead(op[1], "killed")
    else:
        clock.now += op[1]
        t.tick()


@settings(max_examples=300, deadline=None)
@given(ops)
def test_every_room_ends_in_exactly_one_terminal_state(seq: list[tuple]) -> None:
    t, clock = table(tombstone_ttl_s=1e9, fence_lease_s=30.0)
    ended: dict[str, RoomState] = {}
    released: list[str] = []
    for op in seq:
        _run(t, clock, op)
        for rec in t.rooms():
            if rec.id in ended:
                assert rec.state is ended[rec.id], "a terminal state changed"
            elif rec.state.terminal:
                ended[rec.id] = rec.state
        for rel in t.take_releases():
            assert t.state(rel.room) in (S.FAILED, S.ABORTED) and t.get(rel.room).fenced
            released.append(rel.room)
    assert len(released) == len(set(released)), "a release was reported twice"
    # Drain: abort everything, let leases run out. Every room ended once, every block is back.
    for room in ROOMS:
        t.abort(room)
    clock.now += 31.0
    t.tick()
    released += [r.room for r in t.take_releases()]
    assert len(released) == len(set(released))
    terminal_counts = sum(v for k, v in t.counters.items() if k.startswith("rooms_"))
    assert terminal_counts == len(t) == len(ROOMS)
    for rec in t.rooms():
        assert rec.state.terminal and rec.releasable
        if rec.has_blocks and rec.state is not S.DONE:
            assert rec.id in released


@settings(max_examples=200, deadline=None)
@given(ops, st.sampled_from(ROOMS))
def test_abort_is_idempotent_anywhere(seq: list[tuple], room: str) -> None:
    t, clock = table()
    for op in seq:
        _run(t, clock, op)
    t.abort(room)
    state, counters = t.state(room), dict(t.counters)
    assert t.abort(room) is Outcome.NOOP
    assert t.state(room) is state and state.terminal
    assert t.counters["abort_repeated"] == counters.get("abort_repeated", 0) + 1


@settings(max_examples=200, deadline=None)
@given(ops)
def test_tombstones_refuse_late_adds(seq: list[tuple]) -> None:
    t, clock = table(tombstone_ttl_s=1e9)
    for op in seq:
        _run(t, clock, op)
        for rec in t.rooms():
            if rec.state.terminal:
                assert step(rec.state, E.ALLOCATE).outcome is Outcome.REFUSED
    for rec in t.rooms():
        if rec.state.terminal:
            assert t.apply(rec.id, E.ALLOCATE) is Outcome.REFUSED
