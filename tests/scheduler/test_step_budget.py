"""The step budget (docs/step-budget.md): a step in which a request samples (a decode, a
prompt's last chunk) computes at most `max_prefill_tokens` prompt tokens only for their KV, so
a step beside decodes stays short and prompts that arrive together start one after another; a
step where nothing samples spends all of max_num_batched_tokens."""
from __future__ import annotations

import pytest

from pdserve.engine.config import CPU_PREFILL_TOKENS, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvcache import BlockAllocator
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig
from pdserve.scheduler.plan import SampledToken, StepPlan


def make(prefill: int | None, caching: bool = False) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                     max_prefill_tokens=prefill), BlockAllocator(64, caching=caching),
                     frozenset())


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


def test_the_default_budget_bounds_prompts_on_a_cpu_only():
    assert EngineConfig(device="cpu").prefill_budget() == CPU_PREFILL_TOKENS
    assert EngineConfig(device="cuda:0").prefill_budget() is None
    assert EngineConfig(device="cuda", max_prefill_tokens=128).prefill_budget() == 128
    with pytest.raises(ValueError):
        EngineConfig(max_prefill_tokens=0).prefill_budget()


def test_the_flag_reaches_every_worker_and_the_prefill_worker_keeps_no_default():
    """`serve --max-prefill-tokens` travels to the workers' command lines; a PD prefill worker,
    on whose steps no stream waits, gets the bound only when it is given."""
    from pdserve.cli import build_parser, engine_config
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sequence import KVRole
    from pdserve.launcher import engine_flags

    flags = engine_flags(build_parser().parse_args(["serve", "--max-prefill-tokens", "96"]))
    assert flags[flags.index("--max-prefill-tokens") + 1] == "96"
    assert engine_config(build_parser().parse_args(["worker", "--role", "both", *flags])).max_prefill_tokens == 96
    assert "--max-prefill-tokens" not in engine_flags(build_parser().parse_args(["serve"]))
    budget = {role: LLMEngine(EngineConfig(), role).scheduler.config.max_prefill_tokens
              for role in (KVRole.LOCAL, KVRole.PREFILL, KVRole.DECODE)}
    assert budget == {KVRole.LOCAL: CPU_PREFILL_TOKENS, KVRole.PREFILL: None, KVRole.DECODE: CPU_PREFILL_TOKENS}
    assert LLMEngine(EngineConfig(max_prefill_tokens=96), KVRole.PREFILL).scheduler.config.max_prefill_tokens == 96
