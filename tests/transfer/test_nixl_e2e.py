"""Two processes, real NIXL over UCX on loopback: data integrity and abort while in flight."""
from __future__ import annotations

import time

import pytest

from .conftest import SOURCE_SEED, SPEC
from .harness import Agent, expected_bytes, kind

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def settle(target: Agent, source: Agent, room: str) -> None:
    """Make sure the connection is warm (the first write sets it up) before pausing a side."""
    target.call("expect", room, source.name, [63])
    assert source.call("write", room, target.name, [63], [63], b"")
    target.wait_for(kind("RoomDone", room))
    source.wait_for(kind("RoomWritten", room))


def stays(check, seconds: float) -> None:
    """`check()` holds during the whole window: for what must *not* happen while a side is
    paused (a negative check, so a window, not a wait for a condition)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        check()
        time.sleep(0.01)


def no_event(agent: Agent, room: str, name: str):
    def check() -> None:
        assert not [e for e in agent.events_of(room) if type(e).__name__ == name], (agent.name, room, name)
    return check


def test_scattered_blocks_arrive_byte_exact_before_the_payload(procs) -> None:
    target, source = procs
    src, dst = [3, 7, 1, 12, 40, 62], [0, 9, 5, 2, 33, 17]
    assert target.call("expect", "exact", source.name, dst)
    t0 = time.time()
    assert source.call("write", "exact", target.name, src, dst, b"\x00\x00\x30\x39")
    ts, done = target.wait_for(kind("RoomDone", "exact"))
    assert done.payload == b"\x00\x00\x30\x39" and done.peer == source.name
    source.wait_for(kind("RoomWritten", "exact"))
    # Snapshot taken in the poll iteration that saw the completion: data was already there.
    assert target.call("snapshot", "exact") == expected_bytes(SPEC, SOURCE_SEED, src)
    untouched = [1, 3, 4, 50]
    assert target.call("blocks", untouched) == bytes(len(expected_bytes(SPEC, 0, untouched)))
    print(f"6 blocks x {SPEC.num_tensors} tensors: completion seen {1e3 * (ts - t0):.1f} ms "
          "after the write call")


def test_target_abort_in_flight_holds_blocks_until_fenced(procs) -> None:
    target, source = procs
    settle(target, source, "warm-t")
    target.call("expect", "abort-t", source.name, [20, 21])
    target.call("pause", True)  # the target stops polling: the write cannot complete
    assert source.call("write", "abort-t", target.name, [20, 21], [20, 21], b"x")
    stays(lambda: source.call("state", "abort-t") == "transferring" or pytest.fail("completed"), 0.2)
    target.call("abort", "abort-t")  # decode side aborts (client left); the source is told
    assert target.call("state", "abort-t") == "aborted"
    source.wait_for(kind("RoomAborted", "abort-t"))
    # In flight: neither side may reuse the blocks yet.
    stays(lambda: (no_event(source, "abort-t", "Fenced")(), no_event(target, "abort-t", "Fenced")()), 0.3)
    target.call("pause", False)
    source.wait_for(kind("Fenced", "abort-t"))
    target.wait_for(kind("Fenced", "abort-t"))
    assert not [e for e in source.events_of("abort-t") if type(e).__name__ == "RoomWritten"]
    assert not [e for e in target.events_of("abort-t") if type(e).__name__ == "RoomDone"]
    assert target.call("metrics")["rooms_unfenced"] == 0


def test_source_abort_in_flight_holds_blocks_until_fenced(procs) -> None:
    target, source = procs
    settle(target, source, "warm-s")
    target.call("expect", "abort-s", source.name, [30])
    target.call("pause", True)
    assert source.call("write", "abort-s", target.name, [30], [30], b"x")
    source.call("abort", "abort-s")  # prefill side aborts; the target is told
    source.call("abort", "abort-s")  # idempotent
    assert source.call("state", "abort-s") == "aborted"
    stays(no_event(source, "abort-s", "Fenced"), 0.3)  # the write is in flight: no fence yet
    target.call("pause", False)
    target.wait_for(kind("RoomAborted", "abort-s"))
    target.wait_for(kind("Fenced", "abort-s"))
    source.wait_for(kind("Fenced", "abort-s"))
    assert target.call("state", "abort-s") == "aborted"
    assert source.call("metrics")["abort_repeated"] >= 1


def test_forget_peer_with_a_write_in_flight(procs) -> None:
    """Dropping a target whose write is in flight: no crash, the room fails on both sides,
    the source's blocks are fenced at once, and reconnecting works."""
    target, source = procs
    settle(target, source, "warm-f")
    target.call("expect", "forgot", source.name, [50])
    target.call("pause", True)
    assert source.call("write", "forgot", target.name, [50], [50], b"x")
    source.call("forget", target.name)
    source.wait_for(kind("RoomFailed", "forgot"))
    source.wait_for(kind("Fenced", "forgot"))
    source.wait_for(kind("PeerDead"))
    assert source.call("metrics")["writes_in_flight"] == 0
    target.call("pause", False)
    target.wait_for(kind("RoomFailed", "forgot"))
    assert source.call("connect", target.info) == target.name
    settle(target, source, "after-forget")
