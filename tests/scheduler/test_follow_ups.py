"""Follow-ups: the score of finishes answered by new prompts, and the plans that wait for one."""
from __future__ import annotations

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import FinishReason
from pdserve.kvcache import BlockAllocator
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig
from pdserve.scheduler.follow_ups import FollowUps
from pdserve.scheduler.plan import SampledToken

WINDOW = 0.02


PROMPT = list(range(100, 140))
TURN = PROMPT + [7, 8, 9, 10]  # the conversation, its answer and the next message


def unfollowed(f: FollowUps, n: int, at: float = 1.0) -> float:
    """`n` finishes that no turn follows, the last one's time to be followed over; the time then."""
    for i in range(n):
        f.finished(PROMPT, at + i, waited=True)
    return at + n


def test_a_new_worker_waits_until_three_finishes_go_unfollowed():
    f = FollowUps(WINDOW)
    assert f.wait(0.0) == WINDOW
    now = unfollowed(f, 2)
    assert f.wait(now) == WINDOW
    f.finished(PROMPT, now, waited=True)
    assert f.wait(now + WINDOW / 2) == WINDOW  # still inside the wait: not decided yet
    assert f.wait(now + WINDOW * 1.5) == 0.0


def test_a_followed_finish_starts_the_waits_again():
    f = FollowUps(WINDOW)
    now = unfollowed(f, 3)
    assert f.wait(now) == 0.0
    f.finished(PROMPT, now, waited=False)
    f.arrived(TURN, now + 0.03)  # not waited for: twice the wait counts (the forward slowed its way back)
    assert f.wait(now + 1) == WINDOW


@pytest.mark.parametrize("when, prompt", [
    (0.99, TURN),                    # came before the answer went out
    (1.0 + WINDOW * 1.5, TURN),      # later than the wait
    (1.005, list(range(200, 260))),  # another conversation
    (1.005, PROMPT[:20] + [1] * 30),  # the same start (a system prompt), then another conversation
], ids=["before", "late", "other", "same-start"])
def test_what_does_not_follow_a_finish(when, prompt):
    f = FollowUps(WINDOW)
    f.finished(PROMPT, 1.0, waited=True)
    f.arrived(prompt, when)
    f.wait(2.0)
    assert f.score == pytest.approx(0.75)


def test_a_turn_follows_though_the_template_rewrote_the_prompts_last_tokens():
    f = FollowUps(WINDOW)
    f.finished(PROMPT, 1.0, waited=True)
    f.arrived(PROMPT[:-3] + [1, 2, 3, 4, 5], 1.01)  # e.g. `<think>` opened the answer, `</think>` closes it
    f.wait(2.0)
    assert f.score == 1.0


def test_turns_follow_their_own_finishes():
    f = FollowUps(WINDOW)
    other = list(range(300, 340))
    f.finished(PROMPT, 1.0, waited=False)
    f.finished(other, 1.0, waited=False)
    f.arrived(other + [5], 1.01)
    f.arrived(other + [6], 1.012)  # follows nothing left: the first took `other`'s finish
    f.wait(2.0)
    assert f.score == pytest.approx(0.75)  # followed, then PROMPT's finish unfollowed


def test_no_window_never_waits():
    f = FollowUps(0.0)
    f.finished(PROMPT, 1.0, waited=False)
    f.arrived(TURN, 1.0)
    assert f.wait(1.0) == 0.0


def make(num_blocks=32, budget=16, max_seqs=4) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=4, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     max_model_len=64), BlockAllocator(num_blocks), frozenset({2}))


def req(rid: str, n: int, max_tokens: int) -> NewRequest:
    return NewRequest(rid, list(range(10, 10 + n)), SamplingParams(temperature=0, max_tokens=max_tokens))


def step(s: Scheduler, no: int, inbox: Inbox, sampled: list[SampledToken]):
    """Plan and apply one step; the tokens its batch samples (a fixed one)."""
    plan = s.plan(no, inbox, sampled)
    outputs, batch = s.apply(plan)
    return plan, outputs, [SampledToken(q.request_id, 5) for q, start, n in batch if start + n == q.num_tokens]


def to_last_token(s: Scheduler, *requests: NewRequest) -> tuple[int, list[SampledToken]]:
    """Run until a plan would hand out `a`'s last token (max_tokens 2): the step number and tokens."""
    _, _, sampled = step(s, 0, Inbox(new=list(requests)), [])
    _, _, sampled = step(s, 1, Inbox(), sampled)
    return 2, sampled


def test_a_plan_that_finishes_a_request_beside_decodes_holds_them_for_its_next_turn():
    s = make()
    no, sampled = to_last_token(s, req("a", 6, max_tokens=2), req("b", 5, max_tokens=20))
    plan, outputs, _ = step(s, no, Inbox(follow_up_wait=WINDOW), sampled)
    assert plan.follow_up_wait == WINDOW and plan.batch == []
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finish_reason] == [("a", FinishReason.LENGTH)]
    # b's token is out; it is not computed on until the next plan, which takes the turn beside it
    assert s.seqs["b"].num_pending == 1
    plan, _, _ = step(s, no + 1, Inbox(new=[req("a2", 9, max_tokens=2)], follow_up_wait=WINDOW), [])
    assert [(c.request_id, c.num_tokens) for c in plan.batch] == [("b", 1), ("a2", 9)]
    assert plan.follow_up_wait == 0.0
    s.allocator.check_integrity()


def test_without_a_window_the_decodes_run_at_once():
    s = make()
    no, sampled = to_last_token(s, req("a", 6, max_tokens=2), req("b", 5, max_tokens=20))
    plan = s.plan(no, Inbox(), sampled)
    assert [c.request_id for c in plan.batch] == ["b"] and plan.follow_up_wait == 0.0


@pytest.mark.parametrize("case", ["alone", "prompt waiting", "prompt part-computed", "new request", "abort"])
def test_a_plan_with_other_work_or_none_does_not_wait(case):
    s = make(budget={"prompt part-computed": 8}.get(case, 16), max_seqs={"prompt waiting": 2}.get(case, 4))
    others = {"alone": [], "prompt part-computed": [req("long", 30, 4)],
              "prompt waiting": [req("b", 5, 20), req("c", 3, 4)]}.get(case, [req("b", 5, 20)])
    no, sampled = to_last_token(s, req("a", 6, max_tokens=2), *others)
    if case == "prompt part-computed":
        assert 0 < s.seqs["long"].num_computed < 30
    if case == "prompt waiting":
        assert [q.request_id for q in s.waiting] == ["c"]  # no slot for it while a and b run
    inbox = Inbox(follow_up_wait=WINDOW)
    if case == "new request":
        inbox.new = [req("c", 3, 4)]
    if case == "abort":
        sampled = [t for t in sampled if t.request_id != "a"]
        inbox.aborts = [("a", FinishReason.ABORT)]
    plan = s.plan(no, inbox, sampled)
    assert plan.follow_up_wait == 0.0
    expected = {"alone": [], "prompt waiting": ["b", "c"], "prompt part-computed": ["long"],
                "new request": ["b", "c"], "abort": ["b"]}[case]
    assert [c.request_id for c in plan.batch] == expected


def test_the_flag_reaches_the_workers_and_a_worker_on_a_cpu_waits_by_default():
    """`serve --follow-up-wait-ms` travels to the workers' command lines; a worker given none
    waits CPU_FOLLOW_UP_WAIT_MS on a CPU and never on a GPU; `pdserve generate`, which no turn
    follows, never waits."""
    from pdserve.cli import build_parser, engine_config
    from pdserve.engine.config import CPU_FOLLOW_UP_WAIT_MS, EngineConfig
    from pdserve.launcher import engine_flags

    flags = engine_flags(build_parser().parse_args(["serve", "--follow-up-wait-ms", "35"]))
    assert flags[flags.index("--follow-up-wait-ms") + 1] == "35.0"
    assert engine_config(build_parser().parse_args(["worker", "--role", "both", *flags])).follow_up_wait() == 0.035
    assert "--follow-up-wait-ms" not in engine_flags(build_parser().parse_args(["serve"]))
    worker = engine_config(build_parser().parse_args(["worker", "--role", "both"]))
    assert worker.follow_up_wait() == CPU_FOLLOW_UP_WAIT_MS / 1000
    assert EngineConfig(device="cuda", follow_up_wait_ms=None).follow_up_wait() == 0.0
    assert engine_config(build_parser().parse_args(["generate", "hi"])).follow_up_wait() == 0.0
    with pytest.raises(ValueError, match="at least 0"):
        EngineConfig(follow_up_wait_ms=-1).follow_up_wait()
