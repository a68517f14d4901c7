"""A peer SIGKILLed mid-transfer: the survivor fails and fences the room within ~2 s, keeps
serving, and a restarted peer with the same name reconnects."""
from __future__ import annotations

import time

import pytest

from .conftest import SOURCE_SEED, SPEC
from .harness import Agent, expected_bytes, kind

pytestmark = [pytest.mark.e2e, pytest.mark.chaos, pytest.mark.timeout(120)]

DETECT_S = 2.0


def test_target_killed_mid_transfer(procs) -> None:
    _, source = procs
    name = "pdserve-decode-victim-tp0"
    victim = Agent("target", name, SPEC)
    successor = Agent("target", name, SPEC)  # same name, started now, connected after the kill
    try:
        victim.ready()
        successor.ready()
        assert source.call("connect", victim.info) == name
        victim.call("expect", "warm", source.name, [0])
        source.call("write", "warm", name, [0], [0], b"")
        victim.wait_for(kind("RoomDone", "warm"))

        victim.call("expect", "kt", source.name, [1, 2, 3])
        victim.call("expect", "kt2", source.name, [4, 5])
        victim.call("pause", True)  # the writes stay in flight
        assert source.call("write", "kt", name, [1, 2, 3], [1, 2, 3], b"x")
        assert source.call("write", "kt2", name, [4, 5], [4, 5], b"y")  # two handles: one death
        assert source.call("metrics")["writes_in_flight"] == 2
        mark = source.mark()
        killed_at = victim.kill()

        ts, failed = source.wait_for(kind("RoomFailed", "kt"), timeout=DETECT_S + 1, since=mark)
        assert ts - killed_at < DETECT_S, f"failure seen {ts - killed_at:.3f}s after the kill"
        assert failed.peer_dead, failed  # its cause is typed: the router answers 503, not 500
        source.wait_for(kind("PeerDead"), since=mark)
        for room in ("kt", "kt2"):  # the first handle's error drains the second: never used again
            source.wait_for(kind("RoomFailed", room), since=mark)
            source.wait_for(kind("Fenced", room), since=mark)
            assert source.call("state", room) == "failed"
        print(f"target killed: source saw the failure after {1e3 * (ts - killed_at):.0f} ms")

        # A room admitted with the dead process's cached bootstrap (it cannot connect) fails as a
        # dead peer's.
        mark = source.mark()
        assert source.call("connect", victim.info) == name
        assert source.call("write", "late", name, [7], [7], b"z")
        _, late = source.wait_for(kind("RoomFailed", "late"), since=mark)
        assert late.peer_dead, late
        source.wait_for(kind("Fenced", "late"), since=mark)

        # The survivor still serves: the restarted target (same name) reconnects.
        assert source.call("connect", successor.info) == name
        successor.wait_for(kind("PeerConnected"))
        successor.call("expect", "after", source.name, [5, 6])
        assert source.call("write", "after", name, [9, 10], [5, 6], b"ok")
        successor.wait_for(kind("RoomDone", "after"))
        assert successor.call("snapshot", "after") == expected_bytes(SPEC, SOURCE_SEED, [9, 10])
        assert source.call("metrics")["writes_in_flight"] == 0
    finally:
        victim.kill()
        successor.stop()


def test_source_killed_mid_transfer(procs) -> None:
    target, _ = procs
    name = "pdserve-prefill-victim-tp0"
    victim = Agent("source", name, SPEC, seed=SOURCE_SEED)
    successor = Agent("source", name, SPEC, seed=SOURCE_SEED)
    try:
        victim.ready()
        successor.ready()
        mark = target.mark()
        assert victim.call("connect", target.info) == target.name
        target.wait_for(kind("PeerConnected"), since=mark)

        target.call("expect", "ks-wait", name, [40])         # prefill still computing
        target.call("expect", "ks-flight", name, [41, 42])   # write under way
        target.call("pause", True)
        assert victim.call("write", "ks-flight", target.name, [1, 2], [41, 42], b"x")
        mark = target.mark()
        killed_at = victim.kill()
        target.call("pause", False)

        ts, failed = target.wait_for(kind("RoomFailed", "ks-wait"), timeout=DETECT_S + 1, since=mark)
        assert ts - killed_at < DETECT_S, f"failure seen {ts - killed_at:.3f}s after the kill"
        assert failed.peer_dead, failed
        target.wait_for(kind("Fenced", "ks-wait"), since=mark)
        target.wait_for(kind("PeerDead"), since=mark)
        print(f"source killed: target saw the failure after {1e3 * (ts - killed_at):.0f} ms")
        # The write in flight either landed completely (done) or failed and was fenced.
        flight = [type(e).__name__ for e in target.events_of("ks-flight")]
        assert flight in (["RoomDone"], ["RoomFailed", "Fenced"]), flight
        assert target.call("metrics")["rooms_unfenced"] == 0

        # A restarted source with the same name is a new incarnation: accepted.
        mark = target.mark()
        assert successor.call("connect", target.info) == target.name
        target.wait_for(kind("PeerConnected"), since=mark)
        target.call("expect", "ks-after", name, [43])
        assert successor.call("write", "ks-after", target.name, [7], [43], b"ok")
        target.wait_for(kind("RoomDone", "ks-after"))
        assert target.call("snapshot", "ks-after") == expected_bytes(SPEC, SOURCE_SEED, [7])
    finally:
        victim.kill()
        successor.stop()


def test_restarted_target_replaces_the_old_incarnation(procs) -> None:
    """connect() with a new incarnation of a known name drops the old one (PeerDead) first."""
    _, source = procs
    name = "pdserve-decode-restart-tp0"
    first = Agent("target", name, SPEC)
    second = Agent("target", name, SPEC)
    try:
        first.ready()
        second.ready()
        source.call("connect", first.info)
        first.call("expect", "rs", source.name, [0])
        mark = source.mark()
        first.kill()
        t0 = time.time()
        assert source.call("connect", second.info) == name  # before any write noticed
        _, dead = source.wait_for(kind("PeerDead"), since=mark)
        assert dead.peer == name and time.time() - t0 < DETECT_S
        second.wait_for(kind("PeerConnected"))
        second.call("expect", "rs2", source.name, [1])
        source.call("write", "rs2", name, [1], [1], b"")
        second.wait_for(kind("RoomDone", "rs2"))
    finally:
        first.kill()
        second.stop()
