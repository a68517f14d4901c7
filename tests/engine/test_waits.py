"""`LLMEngine.waits`: whether the next step has nothing to do until something comes from outside.
A worker naps after such a step instead of stepping at once. The case it exists for: a room
whose KV is being written counts as work (`has_work`), yet every step while the write runs
changes nothing; stepping through it at once spun a core (docs/liveness.md)."""
from __future__ import annotations

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import FinishReason, KVRole
from pdserve.scheduler.plan import TransferKind, TransferOutcome


class HeldWrite:
    """A prefill rank's link whose write of a room ends only when the test says so."""

    def __init__(self) -> None:
        self.writing: list[str] = []
        self.done: list[str] = []

    def act(self, plan, outputs, held) -> None:
        self.writing += [o.request_id for o in outputs if o.finish_reason is FinishReason.KV_PENDING]

    def observe(self) -> list[TransferOutcome]:
        out = [TransferOutcome(rid, TransferKind.WRITTEN) for rid in self.done]
        self.done = []
        return out


def test_a_step_waits_only_while_a_room_is_written_and_nothing_else_is_pending(tiny_llama_dir):
    e = LLMEngine(EngineConfig(model=tiny_llama_dir, block_size=4, max_num_batched_tokens=48),
                  kv_role=KVRole.PREFILL)
    link = HeldWrite()
    e.attach_link(link)
    e.add_request("a", [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0, max_tokens=4))
    plan, _ = e.step()  # the prompt's forward: its token is pending
    assert plan.batch and not e.waits(plan)
    plan, _ = e.step()  # the token hands the room to the link
    assert link.writing == ["a"] and not e.waits(plan)
    for _ in range(3):  # the write runs: work is held, but a step does nothing
        plan, _ = e.step()
        assert e.has_work() and plan.idle and e.waits(plan)
    e.add_request("b", [11, 12, 13], SamplingParams(temperature=0, max_tokens=4))
    assert not e.waits(plan)  # a request arrived: step at once
    plan, _ = e.step()
    assert plan.batch and not e.waits(plan)
    e.step()  # b's token hands its room to the link
    link.done.append("a")
    plan, _ = e.step()  # the write's outcome: a step that changed something
    assert any(t.request_id == "a" for t in plan.transfers) and not e.waits(plan)
    link.done.append("b")
    while e.has_work():
        e.step()
    assert e.allocator.num_used == 0
