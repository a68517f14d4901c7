"""Real NIXL agents, target and source in this one process, polled in turn: the protocol's
fast checks (aborts, fences, leases, refusals, handle discipline). Cross-process behaviour,
data integrity and kills are in test_nixl_e2e.py / test_nixl_chaos.py."""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Iterator

import pytest
import torch

from pdserve.transfer.base import TransferConfig
from pdserve.transfer.events import (Fenced, PeerConnected, RoomAborted, RoomDone, RoomFailed,
                                     RoomWritten)
from pdserve.transfer.layout import LayoutMismatch, PoolLayout
from pdserve.transfer.nixl_backend import HandleReleased, NixlEndpoint, WrongThread, XferStatus
from pdserve.transfer.nixl_source import NixlSource
from pdserve.transfer.nixl_target import NixlTarget
from pdserve.transfer.rooms import RoomState

pytestmark = pytest.mark.timeout(60)
_ids = itertools.count()


def make_pool(num_tensors: int = 3, num_blocks: int = 8, fill: float | None = None,
              block: tuple[int, ...] = (4, 16)) -> list[torch.Tensor]:
    if fill is None:
        return [torch.zeros(num_blocks, *block) for _ in range(num_tensors)]
    return [torch.full((num_blocks, *block), fill + i) for i in range(num_tensors)]


class Pair:
    def __init__(self, **config: Any):
        n = next(_ids)
        cfg = TransferConfig(**config)
        self.tpool, self.spool = make_pool(), make_pool(fill=1.0)
        self.target = NixlTarget(f"pdserve-decode-l{n}-tp0", self.tpool, cfg)
        self.source = NixlSource(f"pdserve-prefill-l{n}-tp0", self.spool, cfg)
        self.tev: list[Any] = []
        self.sev: list[Any] = []

    def pump(self, until: Callable[[], bool] = lambda: False, timeout: float = 3.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.tev += self.target.poll()
            self.sev += self.source.poll()
            if until():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"target saw {self.tev}, source saw {self.sev}")
            time.sleep(0.001)

    def connect(self) -> str:
        peer = self.source.connect(self.target.bootstrap_info())
        self.pump(lambda: PeerConnected(self.source.name) in self.tev)
        return peer

    def close(self) -> None:
        self.source.close()
        self.target.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_write_delivers_blocks_then_payload(pair: Pair) -> None:
    peer = pair.connect()
    assert pair.target.expect("r", pair.source.name)
    assert pair.source.write("r", peer, [1, 6], [5, 0], b"first-token")
    pair.pump(lambda: RoomDone("r", b"first-token", pair.source.name) in pair.tev)
    pair.pump(lambda: RoomWritten("r", peer) in pair.sev)
    for t in range(3):
        assert torch.equal(pair.tpool[t][5], pair.spool[t][1])
        assert torch.equal(pair.tpool[t][0], pair.spool[t][6])
        assert not pair.tpool[t][1].any()
    assert pair.target.state("r") is RoomState.DONE and pair.source.state("r") is RoomState.DONE


def test_zero_block_write_delivers_the_payload(pair: Pair) -> None:
    peer = pair.connect()
    pair.target.expect("z", pair.source.name)
    assert pair.source.write("z", peer, [], [], b"p")
    pair.pump(lambda: RoomDone("z", b"p", pair.source.name) in pair.tev)


def test_connect_refuses_a_layout_mismatch() -> None:
    target = NixlTarget("pdserve-decode-mm-tp0", make_pool(num_tensors=2))
    source = NixlSource("pdserve-prefill-mm-tp0", make_pool(num_tensors=3))
    with pytest.raises(LayoutMismatch, match="3 pool tensors here, 2 there"):
        source.connect(target.bootstrap_info())
    other = NixlTarget("pdserve-decode-mm-tp1", make_pool(block=(8, 16)))
    with pytest.raises(LayoutMismatch, match="bytes per block"):
        source.connect(other.bootstrap_info())
    for agent in (source, target, other):
        agent.close()


def test_connect_is_idempotent_for_one_incarnation(pair: Pair) -> None:
    peer = pair.connect()
    assert pair.source.connect(pair.target.bootstrap_info()) == peer
    assert pair.source.metrics()["peers"] == 1


def test_abort_before_the_write_fences_at_once_and_refuses_the_write(pair: Pair) -> None:
    peer = pair.connect()
    pair.target.expect("a", pair.source.name)
    pair.target.abort("a")
    pair.target.abort("a")  # idempotent
    pair.pump(lambda: Fenced("a", "sender fence") in pair.tev)
    assert pair.source.state("a") is RoomState.ABORTED  # tombstone from the target's abort
    assert pair.source.write("a", peer, [0], [0]) is False
    assert pair.source.metrics()["allocate_refused"] == 1
    assert pair.target.metrics()["abort_repeated"] == 1


def test_an_abort_before_the_source_connects_reaches_it_on_connect() -> None:
    p = Pair()
    p.target.expect("pre", p.source.name)
    p.target.abort("pre")  # the source is not connected yet: nobody to tell
    peer = p.connect()
    p.pump(lambda: p.source.state("pre") is RoomState.ABORTED)
    assert p.source.write("pre", peer, [0], [0]) is False
    p.pump(lambda: Fenced("pre", "sender fence") in p.tev)
    p.close()


def test_source_abort_reaches_the_target(pair: Pair) -> None:
    peer = pair.connect()
    pair.target.expect("s", pair.source.name)
    pair.target.poll()
    pair.source.abort("s")  # unknown to the source yet: a tombstone, no peer to tell
    assert pair.source.write("s", peer, [0], [0]) is False
    pair.target.abort("s")  # the router aborts both sides
    pair.pump(lambda: any(isinstance(e, Fenced) and e.room == "s" for e in pair.tev))


def test_a_prefill_failure_reaches_the_decode_side_at_once(pair: Pair) -> None:
    peer = pair.connect()
    pair.target.expect("f", pair.source.name)
    assert pair.source.write("f", peer, [0, 99], [0, 1])  # accepted, then failed
    pair.pump(lambda: any(isinstance(e, Fenced) and e.room == "f" for e in pair.tev))
    assert RoomFailed("f", "block index out of range") in pair.tev
    assert RoomFailed("f", "block index out of range") in pair.sev
    assert Fenced("f", "no write in flight") in pair.sev
    assert pair.target.state("f") is RoomState.FAILED


def test_aborted_room_without_a_known_source_is_fenced_by_lease() -> None:
    target = NixlTarget("pdserve-decode-lease-tp0", make_pool(),
                        TransferConfig(fence_lease_s=0.2))
    target.expect("l")  # source unknown: nobody to tell, nobody to answer
    target.abort("l")
    t0 = time.monotonic()
    events: list[Any] = []
    while not events:
        events = [e for e in target.poll() if isinstance(e, Fenced)]
        assert time.monotonic() - t0 < 2.0
        time.sleep(0.005)
    assert events == [Fenced("l", "fence lease expired")]
    assert time.monotonic() - t0 >= 0.2
    target.close()


def test_expect_after_a_source_failure_is_refused(pair: Pair) -> None:
    peer = pair.connect()
    assert pair.source.write("early", peer, [0], [0, 1])  # fails: count mismatch
    pair.pump(lambda: pair.target.state("early") is RoomState.FAILED)
    assert pair.target.expect("early", pair.source.name) is False
    assert not any(getattr(e, "room", None) == "early" for e in pair.tev)  # no blocks, no event


def test_abort_after_done_is_a_noop_on_both_sides(pair: Pair) -> None:
    peer = pair.connect()
    pair.target.expect("pa", pair.source.name)
    pair.source.write("pa", peer, [2], [2])
    pair.pump(lambda: RoomWritten("pa", peer) in pair.sev and pair.target.state("pa").terminal)
    pair.target.abort("pa")
    pair.source.abort("pa")
    pair.tev += pair.target.poll()
    pair.sev += pair.source.poll()
    assert pair.target.state("pa") is RoomState.DONE and pair.source.state("pa") is RoomState.DONE
    assert pair.target.metrics()["abort_repeated"] == 1
    assert pair.source.metrics()["abort_repeated"] == 1
    assert not any(isinstance(e, (Fenced, RoomAborted)) for e in pair.tev + pair.sev)


def test_handles_are_released_once_and_never_touched_after() -> None:
    a = NixlEndpoint("pdserve-test-ha-tp0", PoolLayout.of(src := make_pool(fill=2.0)))
    b_pool = make_pool()
    b = NixlEndpoint("pdserve-test-hb-tp0", PoolLayout.of(b_pool))
    a.add_peer(b.name, b.metadata, b.layout)
    idx = a.layout.indices([1])
    h = a.make_write(b.name, idx, idx, b"")
    status = h.post()
    deadline = time.monotonic() + 3
    while status is XferStatus.PROC:
        b.receive()
        status = h.state()
        assert time.monotonic() < deadline
    assert status is XferStatus.DONE and torch.equal(b_pool[2][1], src[2][1])

    errors: list[BaseException] = []
    worker = threading.Thread(target=lambda: _capture(errors, h.state))
    worker.start()
    worker.join()
    assert len(errors) == 1 and isinstance(errors[0], WrongThread)

    h.release()
    assert h.released
    with pytest.raises(HandleReleased):
        h.state()
    with pytest.raises(HandleReleased):
        h.post()
    with pytest.raises(HandleReleased):
        h.release()
    a.close()
    b.close()


def test_agents_refuse_a_second_thread_while_the_owner_lives(pair: Pair) -> None:
    pair.target.poll()  # binds the owner thread
    errors: list[BaseException] = []
    worker = threading.Thread(target=lambda: _capture(errors, pair.target.poll))
    worker.start()
    worker.join()
    assert len(errors) == 1 and isinstance(errors[0], WrongThread)

    # A scheduler thread that ended hands the agent over (e.g. to close it at shutdown).
    scheduler = threading.Thread(target=lambda: _capture(errors, pair.source.poll))
    scheduler.start()
    scheduler.join()
    assert len(errors) == 1
    pair.source.poll()


def _capture(errors: list[BaseException], fn: Callable[[], Any]) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        errors.append(e)


def test_a_dead_peer_notice_fails_and_fences_the_targets_rooms_at_once() -> None:
    """The source never connected (it died first): only the notice can end these rooms before
    the fence lease. A waiting room fails and is fenced; an aborted one is fenced; a completed
    room is left alone; a room not allocated yet is refused later."""
    p = Pair(fence_lease_s=30.0)
    peer = p.connect()
    p.target.expect("done", p.source.name)
    assert p.source.write("done", peer, [0], [0], b"t")
    p.pump(lambda: RoomDone("done", b"t", p.source.name) in p.tev)
    target = NixlTarget("pdserve-decode-gone-tp0", make_pool(), TransferConfig(fence_lease_s=30.0))
    dead = "pdserve-prefill-never-connected-tp0"
    for room in ("waiting", "aborted"):
        assert target.expect(room, dead)
    target.abort("aborted")
    target.poll()
    target.peer_gone(["waiting", "aborted", "later"], "killed")
    events = target.poll()
    assert events == [RoomFailed("waiting", "the prefill worker is dead: killed", peer_dead=True),
                      Fenced("waiting", "peer dead: killed"), Fenced("aborted", "peer dead: killed")]
    assert target.expect("later", dead) is False  # its tombstone refuses the late allocation
    p.target.peer_gone(["done"], "killed")
    assert p.target.poll() == [] and p.target.state("done") is RoomState.DONE
    assert target.metrics()["peer_dead_failed_rooms"] == 1
    target.close()
    p.close()


def test_a_dead_peer_notice_fails_the_sources_rooms_and_refuses_their_writes(pair: Pair) -> None:
    """Decode died: a room not written yet is refused when its KV is ready (the prefill does not
    write into a dead worker); a room already written is left alone."""
    peer = pair.connect()
    pair.target.expect("w", pair.source.name)
    assert pair.source.write("w", peer, [0], [0])
    pair.pump(lambda: RoomWritten("w", peer) in pair.sev)
    pair.source.peer_gone(["w", "next"], "killed")
    assert pair.source.poll() == []
    assert pair.source.state("w") is RoomState.DONE and pair.source.state("next") is RoomState.FAILED
    assert pair.source.write("next", peer, [1], [1]) is False
