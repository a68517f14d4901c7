"""The step budget (docs/step-budget.md): a step in which a request samples (a decode, a
prompt's last chunk) computes at most `max_prefill_tokens` prompt tokens only for their KV, so
a step beside decodes stays short; a step where nothing samples spends all of
max_num_batched_tokens; once a prompt's last chunk is in a step, other prompts add at most
`first_token_slack` tokens to it, so prompts that arrive together start one after another."""
from __future__ import annotations

import pytest

from pdserve.engine.config import CPU_FIRST_TOKEN_SLACK, CPU_PREFILL_TOKENS, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvcache import BlockAllocator
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig
from pdserve.scheduler.plan import SampledToken, StepPlan


def make(prefill: int | None, caching: bool = False, slack: int | None = None) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                     max_prefill_tokens=prefill, first_token_slack=slack),
                     BlockAllocator(64, caching=caching), frozenset())


def req(rid: str, ids: list[int], max_tokens: int = 40) -> NewRequest:
    return NewRequest(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


class Driver:
    """Steps a scheduler, feeding back token 5 for every sequence that reached its end."""

    def __init__(self, s: Scheduler):
        self.s, self.step_no, self.sampled = s, 0, []

    def step(self, new: list[NewRequest] = ()) -> StepPlan:
        plan = self.s.plan(self.step_no, Inbox(new=list(new)), self.sampled)
        _, batch = self.s.apply(plan)
        self.sampled = [SampledToken(q.request_id, 5) for q, start, n in batch if start + n == q.num_tokens]
        self.step_no += 1
        return plan


def chunks(plan: StepPlan) -> list[tuple[str, int]]:
    return [(c.request_id, c.num_tokens) for c in plan.batch]


def test_prompts_beside_decodes_take_at_most_the_prefill_budget():
    d = Driver(make(prefill=8))
    assert chunks(d.step([req("a", list(range(10, 15))), req("b", list(range(20, 25)))])) == [("a", 5), ("b", 5)]
    # c's 20 tokens go 8 by 8 (its last chunk 4: 3 for the KV, 1 sampled from); d (3 tokens:
    # 2 for the KV) waits for budget; the decodes are in every step
    steps = [chunks(d.step([req("c", list(range(30, 50))), req("d", list(range(60, 63)))]))]
    steps += [chunks(d.step()) for _ in range(3)]
    assert steps == [[("a", 1), ("b", 1), ("c", 8)],
                     [("a", 1), ("b", 1), ("c", 8)],
                     [("a", 1), ("b", 1), ("c", 4), ("d", 3)],
                     [("a", 1), ("b", 1), ("c", 1), ("d", 1)]]


def test_a_step_where_nothing_samples_spends_the_whole_budget():
    """A prompt alone goes in chunks of max_num_batched_tokens; only the chunk that samples
    (its last) must be within the prefill budget: the step before leaves it one token."""
    d = Driver(make(prefill=8))
    assert [chunks(d.step([req("long", list(range(10, 70)))]))] + [chunks(d.step()) for _ in range(2)] == [
        [("long", 59)], [("long", 1)], [("long", 1)]]
    # beside a decode, the same prompt goes 8 by 8
    assert chunks(d.step([req("next", list(range(100, 160)))])) == [("long", 1), ("next", 8)]


def test_decodes_never_wait_for_the_prefill_budget():
    d = Driver(make(prefill=1))
    assert len(d.step([req(r, [10 + i]) for i, r in enumerate("abc")]).batch) == 3  # nothing for the KV
    for _ in range(3):
        plan = d.step([req("long", list(range(100, 140)))] if d.step_no == 1 else [])
        assert chunks(plan) == [("a", 1), ("b", 1), ("c", 1), ("long", 1)]


@pytest.mark.parametrize("prefill", [6, None])
def test_later_turns_that_arrive_together_start_one_per_step(prefill):
    """Four turns share a cached 12-token prefix and add 7 tokens each: with a budget of 6 for
    the KV, one starts (and samples its first token) per step; without it, all in one step."""
    d = Driver(make(prefill, caching=True))
    system = list(range(100, 112))
    d.step([req("first", system + [7], max_tokens=1)])
    d.step()
    turns = [req(f"t{i}", system + list(range(200 + 10 * i, 207 + 10 * i))) for i in range(4)]
    plans = [d.step(turns)] + [d.step() for _ in range(3)]
    started = [[(c.request_id, c.num_tokens, c.cached) for c in p.batch if c.cached] for p in plans]
    if prefill is None:
        assert started == [[(f"t{i}", 7, 12) for i in range(4)], [], [], []]
    else:
        assert started == [[(f"t{i}", 7, 12)] for i in range(4)]
        assert [len(p.batch) for p in plans] == [1, 2, 3, 4]  # the earlier turns decode meanwhile


def later_turns(d: Driver) -> list[NewRequest]:
    """Four turns sharing a 12-token prefix (cached by an earlier request), 7 new tokens each."""
    system = list(range(100, 112))
    d.step([req("first", system + [7], max_tokens=1)])
    d.step()
    return [req(f"t{i}", system + list(range(200 + 10 * i, 207 + 10 * i))) for i in range(4)]


def test_with_no_slack_prompts_that_arrive_together_start_one_per_step():
    """No bound beside decodes at all (as on a GPU), but no slack: each turn samples its first
    token in a step of its own, the turns started before decode beside it."""
    d = Driver(make(None, caching=True, slack=0))
    turns = later_turns(d)
    plans = [d.step(turns)] + [d.step() for _ in range(3)]
    assert [chunks(p) for p in plans] == [[("t0", 7)],
                                          [("t0", 1), ("t1", 7)],
                                          [("t0", 1), ("t1", 1), ("t2", 7)],
                                          [("t0", 1), ("t1", 1), ("t2", 1), ("t3", 7)]]


def test_the_slack_lets_short_prompts_join_and_starts_the_next_one_early():
    """Slack 8: t1's 7 tokens fit it (so t1 samples too), t2 gets the 1 token left (for its KV
    only) and t3 nothing; next step t2 samples with its other 6, and t3's 7 fit the slack that
    opens behind it."""
    d = Driver(make(None, caching=True, slack=8))
    turns = later_turns(d)
    plans = [d.step(turns)] + [d.step() for _ in range(2)]
    assert [chunks(p) for p in plans] == [[("t0", 7), ("t1", 7), ("t2", 1)],
                                          [("t0", 1), ("t1", 1), ("t2", 6), ("t3", 7)],
                                          [("t0", 1), ("t1", 1), ("t2", 1), ("t3", 1)]]


def test_the_slack_never_holds_back_decodes_or_a_prompt_alone():
    d = Driver(make(None, slack=0))
    assert chunks(d.step([req(r, [10 + i]) for i, r in enumerate("abc")])) == [("a", 1), ("b", 1), ("c", 1)]
    # a prompt samples beside the decodes: they all still decode; a second prompt gets nothing
    assert chunks(d.step([req("p", list(range(20, 30))), req("q", list(range(40, 50)))])) == [
        ("a", 1), ("b", 1), ("c", 1), ("p", 10)]
    assert chunks(d.step()) == [("a", 1), ("b", 1), ("c", 1), ("p", 1), ("q", 10)]
    # a long prompt alone goes in chunks of the whole budget up to its last
    d = Driver(make(None, slack=0))
    assert [chunks(d.step([req("long", list(range(10, 70)))]))] + [chunks(d.step())] == [
        [("long", 60)], [("long", 1)]]


def test_the_slack_bounds_a_long_prompt_behind_one_that_samples():
    """p samples its first token: the long prompt behind it starts with at most the slack,
    then, with nothing sampling but decodes, goes on at the step's whole budget."""
    d = Driver(make(None, slack=4))
    assert chunks(d.step([req("p", list(range(10, 20))), req("long", list(range(100, 150)))])) == [
        ("p", 10), ("long", 4)]
    assert chunks(d.step()) == [("p", 1), ("long", 46)]


def test_the_default_budget_bounds_prompts_on_a_cpu_only():
    assert EngineConfig(device="cpu").prefill_budget() == CPU_PREFILL_TOKENS
    assert EngineConfig(device="cuda:0").prefill_budget() is None
    assert EngineConfig(device="cuda", max_prefill_tokens=128).prefill_budget() == 128
    with pytest.raises(ValueError):
        EngineConfig(max_prefill_tokens=0).prefill_budget()
    assert EngineConfig(device="cpu").first_token_budget() == CPU_FIRST_TOKEN_SLACK
    assert EngineConfig(device="cuda:0").first_token_budget() is None
    assert EngineConfig(device="cuda", first_token_slack=0).first_token_budget() == 0
    with pytest.raises(ValueError):
        EngineConfig(first_token_slack=-1).first_token_budget()


def test_the_flag_reaches_every_worker_and_the_prefill_worker_keeps_no_default():
    """`serve --max-prefill-tokens` and `--first-token-slack` travel to the workers' command
    lines; a PD prefill worker, on whose steps no stream waits, gets the bound only when it is
    given, but the slack by default (the prompts' first outputs are its own)."""
    from pdserve.cli import build_parser, engine_config
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sequence import KVRole
    from pdserve.launcher import engine_flags

    flags = engine_flags(build_parser().parse_args(["serve", "--max-prefill-tokens", "96", "--first-token-slack", "0"]))
    assert flags[flags.index("--max-prefill-tokens") + 1] == "96"
    assert flags[flags.index("--first-token-slack") + 1] == "0"
    config = engine_config(build_parser().parse_args(["worker", "--role", "both", *flags]))
    assert (config.max_prefill_tokens, config.first_token_slack) == (96, 0)
    assert "--max-prefill-tokens" not in engine_flags(build_parser().parse_args(["serve"]))
    budget = {role: LLMEngine(EngineConfig(), role).scheduler.config.max_prefill_tokens
              for role in (KVRole.LOCAL, KVRole.PREFILL, KVRole.DECODE)}
    assert budget == {KVRole.LOCAL: CPU_PREFILL_TOKENS, KVRole.PREFILL: None, KVRole.DECODE: CPU_PREFILL_TOKENS}
    assert LLMEngine(EngineConfig(), KVRole.PREFILL).scheduler.config.first_token_slack == CPU_FIRST_TOKEN_SLACK
    assert LLMEngine(EngineConfig(max_prefill_tokens=96), KVRole.PREFILL).scheduler.config.max_prefill_tokens == 96
