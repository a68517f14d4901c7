"""Faults a test injects into a worker's ranks, through the same interface the real link has.

A `FaultPlan` is given to the rank runtime (`runtime.py`), which wraps this rank's transfer
link in a `FaultyLink` when the plan names faults for the rank. Production code never builds
one: `FaultPlan.from_env()` is None unless a test set `PDSERVE_TEST_FAULTS` (JSON), e.g.

    {"debug_routes": true,
     "ranks": {"1": {"fail_rooms": "victim-", "delay_rooms": "late-", "delay_s": 1.0}}}

Per TP rank: fail or delay the transfer results of rooms whose id starts with a prefix, sleep
before every poll, stop polling the agent (`stall_file`: while that file exists, this rank
polls nothing, so writes into it stay in flight; the test removes the file to go on), or, on
a prefill rank, hold back the KV of some rooms (`hold_writes`: sampled, never sent).
`debug_routes` adds POST /debug/wedge to the worker's API (the loop stalls, as a hung forward).
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.engine.kv_link import failed_and_fenced
from pdserve.engine.sequence import FinishReason
from pdserve.scheduler.plan import StepOutput, StepPlan, TransferKind, TransferOutcome

ENV = "PDSERVE_TEST_FAULTS"


@dataclass(frozen=True)
class RankFaults:
    """What one rank's transfer link does wrong."""

    fail_rooms: str | None = None   # arrivals of these rooms fail here ("injected fault")
    delay_rooms: str | None = None  # results of these rooms are reported `delay_s` late
    delay_s: float = 0.0
    poll_delay_s: float = 0.0       # a slow rank: sleep before every poll
    stall_file: str | None = None   # while this file exists, the agent is not polled
    hold_writes: str | None = None  # prefill: these rooms' KV is never sent (held until aborted)


@dataclass(frozen=True)
class FaultPlan:
    ranks: Mapping[int, RankFaults] = field(default_factory=dict)
    debug_routes: bool = False  # POST /debug/wedge exists

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultPlan | None:
        spec = json.loads(environ.get(ENV, "{}"))
        if not spec:
            return None
        ranks = {int(r): RankFaults(**f) for r, f in spec.get("ranks", {}).items()}
        return cls(ranks, bool(spec.get("debug_routes")))

    def to_env(self) -> dict[str, str]:
        """The environment that gives a worker process this plan (what a test sets)."""
        ranks = {str(r): {k: v for k, v in vars(f).items() if v} for r, f in self.ranks.items()}
        return {ENV: json.dumps({"debug_routes": self.debug_routes, "ranks": ranks})}

    def wrap(self, link, rank: int):
        """`link` as this rank sees it under the plan (itself when the rank has no faults)."""
        faults = self.ranks.get(rank)
        return link if faults is None else FaultyLink(link, faults)


class FaultyLink:
    """A transfer link (`observe`, `act`, `agent`) that misbehaves as `RankFaults` says."""

    def __init__(self, link, faults: RankFaults):
        self.link, self.faults = link, faults
        self._delayed: list[tuple[float, TransferOutcome]] = []
        self._held_back: set[str] = set()  # rooms whose write was never started (hold_writes)
        self._local: list[TransferOutcome] = []

    @property
    def agent(self):
        return self.link.agent

    def observe(self) -> list[TransferOutcome]:
        f = self.faults
        if f.stall_file and os.path.exists(f.stall_file):
            return []
        if f.poll_delay_s:
            time.sleep(f.poll_delay_s)  # the fault itself: a rank that polls late
        now, out = time.monotonic(), self._local
        self._local = []
        for t in self.link.observe():
            if f.fail_rooms and t.request_id.startswith(f.fail_rooms) and t.kind is TransferKind.ARRIVED:
                self.link.agent.abort(t.request_id)
                out += failed_and_fenced(t.request_id, "injected fault")
            elif f.delay_rooms and t.request_id.startswith(f.delay_rooms):
                self._delayed.append((now + f.delay_s, t))
            else:
                out.append(t)
        out += [t for due, t in self._delayed if due <= now]
        self._delayed = [(due, t) for due, t in self._delayed if due > now]
        return out

    def act(self, plan: StepPlan, outputs: list[StepOutput], held) -> None:
        prefix = self.faults.hold_writes
        if prefix:
            for rid, _ in plan.aborted:  # no write was started: the room is fenced at once
                if rid in self._held_back:
                    self._held_back.discard(rid)
                    self._local += failed_and_fenced(rid, "aborted with its write held back")
            hold = {o.request_id for o in outputs
                    if o.finish_reason is FinishReason.KV_PENDING and o.request_id.startswith(prefix)}
            self._held_back |= hold
            outputs = [o for o in outputs if o.request_id not in hold]
        self.link.act(plan, outputs, held)


class Wedge:
    """A stuck loop on demand (POST /debug/wedge): the next step stalls for the armed time."""

    def __init__(self) -> None:
        self._for = 0.0

    def arm(self, seconds: float) -> None:
        self._for = seconds

    def stall(self) -> None:
        if self._for:
            seconds, self._for = self._for, 0.0
            time.sleep(seconds)  # the fault itself: a forward that hangs
