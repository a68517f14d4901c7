"""Which aborts a worker counts (pdserve/worker/aborts.py): once per running request, by the
origin the router tells, also when the request's stream closed first."""
from __future__ import annotations

from collections import Counter

from pdserve.worker.aborts import AbortLedger


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ledger() -> tuple[AbortLedger, Counter, Clock]:
    counts: Counter = Counter()
    clock = Clock()
    return AbortLedger(lambda origin: counts.update([origin]), grace_s=5.0, clock=clock), counts, clock


def test_abort_of_a_running_request_counts_the_told_origin_once():
    a, counts, _ = ledger()
    a.started("r")
    assert a.told("r", "router") is True
    assert a.told("r", "client") is False  # a second abort changes nothing
    a.finished("r")
    assert counts == {"router": 1}


def test_abort_of_an_unknown_or_finished_request_is_a_noop():
    a, counts, _ = ledger()
    assert a.told("never-seen", "router") is False
    a.started("r")
    a.finished("r")  # the router released it and aborts after the worker finished it
    assert a.told("r", "router") is False
    assert a.reader_left("r") is False
    assert not counts


def test_stream_closed_before_the_told_origin_counts_the_told_origin():
    a, counts, clock = ledger()
    a.started("r")
    assert a.reader_left("r") is True
    a.finished("r")          # the engine ended it (aborted) before the router's /abort came
    clock.now += 1.0
    assert a.told("r", "router") is True
    clock.now += 10.0
    assert a.sweep() == 0
    assert counts == {"router": 1}


def test_stream_closed_without_a_told_origin_counts_client_after_the_grace_period():
    a, counts, clock = ledger()
    a.started("r")
    a.reader_left("r")
    clock.now += 4.9
    assert a.sweep() == 0 and not counts
    clock.now += 0.2
    assert a.sweep() == 1
    assert a.told("r", "router") is False  # too late: already counted
    assert counts == {"client": 1}
