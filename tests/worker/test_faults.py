"""The fault plan a test hands to a worker: off unless set, and the same plan on the other side."""
from __future__ import annotations

from pdserve.worker.faults import FaultPlan, RankFaults


def test_no_plan_unless_a_test_sets_one():
    assert FaultPlan.from_env({}) is None


def test_a_plan_reaches_the_worker_unchanged():
    plan = FaultPlan({1: RankFaults(fail_rooms="victim-", delay_rooms="late-", delay_s=1.0),
                      0: RankFaults(stall_file="/tmp/x", hold_writes="v-")}, debug_routes=True)
    assert FaultPlan.from_env(plan.to_env()) == plan


def test_a_rank_without_faults_keeps_its_own_link():
    link = object()
    assert FaultPlan({1: RankFaults(poll_delay_s=0.1)}).wrap(link, 0) is link
    assert FaultPlan({1: RankFaults(poll_delay_s=0.1)}).wrap(link, 1).link is link
