"""Follow-ups in the engine: the step that hands a session its answer holds the other sessions'
decodes back, the session's next turn then runs in their step, and the tokens are the ones the
engine computes without waiting (plain and overlapped loops)."""
from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams


def make_engine(model_dir: str, wait_ms: float, overlap: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, block_size=4, max_num_batched_tokens=64, dtype="float32",
                                  follow_up_wait_ms=wait_ms, overlap=overlap))


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def session(engine: LLMEngine) -> tuple[dict[str, list[int]], list]:
    """Two sessions: `a` ends after 3 tokens and sends its next turn (the conversation, its answer
    and a new message) the moment its answer is out; `b` decodes on. Every request's tokens, and
    the plans from the one that handed out a's answer on."""
    prompt = list(range(5, 25))
    engine.add_request("a", prompt, params(3))
    engine.add_request("b", [20, 21, 22, 23, 24], params(16))
    tokens: dict[str, list[int]] = {"a": [], "b": [], "a2": []}
    plans, answered = [], None
    while engine.has_work():
        plan, outputs = engine.step()
        plans.append(plan)
        for o in outputs:
            if o.token_id is not None:
                tokens[o.request_id].append(o.token_id)
            if o.request_id == "a" and o.finish_reason is not None:
                engine.add_request("a2", prompt + tokens["a"] + [30, 31, 32], params(2))
                answered = len(plans) - 1
    return tokens, plans[answered:]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_sessions_next_turn_runs_in_the_step_its_answer_held_back(tiny_llama_dir, overlap):
    waiting = make_engine(tiny_llama_dir, 60_000.0, overlap)
    got, plans = session(waiting)
    held = plans[0]
    assert held.follow_up_wait == 60.0 and held.batch == []  # a's answer is out, b's decode held
    # the next plan takes the turn beside b's decode: the turn queues behind no step of b's
    turn = next(p for p in plans[1:] if p.batch)
    assert sorted(c.request_id for c in turn.batch) == ["a2", "b"]
    assert waiting.follow_ups.score > 0.5  # the turn followed the finish
    assert got == session(make_engine(tiny_llama_dir, 0.0, overlap))[0]
    assert len(got["b"]) == 16 and len(got["a2"]) == 2
    waiting.allocator.check_integrity()


def test_the_offline_engine_never_waits(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, block_size=4, dtype="float32"))
    assert engine.follow_ups.wait(0.0) == 0.0
