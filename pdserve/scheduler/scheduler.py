"""Continuous batching with chunked prefill and preemption by recompute.

`plan()` (rank 0 only) is a pure function of the scheduler state and its inputs: it never
mutates anything, so it can be tested without processes. `apply()` (every rank) is the only
place where requests change state and blocks change hands.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.kvcache import BlockAllocator

from .plan import Inbox, NewRequest, SampledToken, ScheduledChunk, StepOutput, StepPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # the chunked-prefill token budget of one step
    max_model_len: int = 8192


@dataclass
class _Slot:
    """The planner's projection of one request after this step's events."""

    seq: Sequence | None
    request_id: str
    num_computed: int
    num_pending: int
    num_blocks: int


class Scheduler:
    """Owns the waiting and running queues and the block allocator."""

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.config = config
        self.allocator = allocator
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self.num_preemptions = 0

    # ---- rank 0: decide -------------------------------------------------------------------

    def plan(self, step: int, inbox: Inbox, sampled: list[SampledToken]) -> StepPlan:
        """The step's decisions, from the state, the inbox and the tokens sampled last step."""
        cfg = self.config
        plan = StepPlan(step=step, sampled=list(sampled), shutdown=inbox.shutdown)
        gone: set[str] = set()
        for s in sampled:
            seq = self.seqs.get(s.request_id)
            if seq is not None and seq.stop_reason(s.token_id, len(seq.output_ids) + 1):
                gone.add(s.request_id)
        for rid, reason in inbox.aborts:
            if rid in self.seqs and rid not in gone:
                plan.aborted.append((rid, reason))
                gone.add(rid)
        seen = set(self.seqs)
        for req in inbox.new:
            error = self._admission_error(req, seen)
            if error:
                plan.rejected.append((req.request_id, error))
            elif req.request_id in {rid for rid, _ in inbox.aborts}:
                plan.rejected.append((req.request_id, "aborted before it started"))
            else:
                plan.admitted.append(req)
            seen.add(req.request_id)
        plan.batch, plan.preempted = self._schedule(gone, sampled, plan.admitted)
        return plan

    def _admission_error(self, req: NewRequest, seen: set[str]) -> str | None:
        if req.request_id in seen:
            return f"duplicate request id {req.request_id!r}"
        if not req.prompt_ids:
            return "the prompt is empty"
        if len(req.prompt_ids) >= self.config.max_model_len:
            return (f"the prompt has {len(req.prompt_ids)} tokens; this model's context is "
                    f"{self.config.max_model_len}")
        if self._blocks_for(len(req.prompt_ids) + 1) > self.allocator.num_blocks:
            return "the prompt does not fit in the KV cache"
        return None

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _schedule(self, gone: set[str], sampled: list[SampledToken], admitted: list[NewRequest]
                  ) -> tuple[list[ScheduledChunk], list[str]]:
        cfg = self.config
        grown = {s.request_id for s in sampled}
        free = self.allocator.num_free
        running: list[_Slot] = []
        for seq in self.running:
            if seq.request_id in gone:
                free += len(seq.block_table)
            else:
                running.append(_Slot(seq, seq.request_id, seq.num_computed,
                                     seq.num_pending + (seq.request_id in grown), len(seq.block_table)))
        waiting = [_Slot(seq, seq.request_id, 0, seq.num_tokens, 0)
                   for seq in self.waiting if seq.request_id not in gone]
        waiting += [_Slot(None, r.request_id, 0, len(r.prompt_ids), 0) for r in admitted]

        budget, batch, preempted = cfg.max_num_batched_tokens, [], []
        scheduled: set[str] = set()
        while running and budget > 0:
            slot = next((s for s in running if s.request_id not in scheduled), None)
            if slot is None:
                break
            n = min(slot.num_pending, budget)
            scheduled.add(slot.request_id)
            need = self._blocks_for(slot.num_computed + n) - slot.num_blocks
            while need > free:  # preempt the newest running request (recomputed later)
                victim = running.pop()
                free += victim.num_blocks
                preempted.append(victim.request_id)
                if victim is slot:
                    break
            if slot.request_id in preempted or n == 0:
                continue
            free -= need
            budget -= n
            batch.append(ScheduledChunk(slot.request_id, n))
        if not preempted:
            num_running = len(running)
            for slot in waiting:
                if budget <= 0 or num_running >= cfg.max_num_seqs:
                    break
                n = min(slot.num_pending, budget)
                need = self._blocks_for(n)
                if need > free:
                    break
                free -= need
                budget -= n
                num_running += 1
                batch.append(ScheduledChunk(slot.request_id, n))
        return batch, preempted

    # ---- every rank: apply ----------------------------------------------------------------

    def apply(self, plan: StepPlan) -> tuple[list[StepOutput], list[tuple[Sequence, int, int]]]:
        """Apply a plan; returns the outputs to emit and the batch as (seq, start, num_tokens)."""
        outputs: list[StepOutput] = []
        for s in plan.sampled:
            seq = self.seqs.get(s.request_id)
            if seq is None:  # aborted after the token was sampled
                continue
            seq.output_ids.append(s.token_id)
            if s.logprobs is not None:
                seq.logprobs.append(s.logprobs)
            reason = seq.stop_reason(s.token_id, len(seq.output_ids))
            outputs.append(StepOutput(seq.request_id, s.token_id, s.logprobs, reason))
            if reason:
                self._finish(seq, reason)
        for rid, reason in plan.aborted:
            seq = self.seqs.get(rid)
            if seq is not None:
                outputs.append(StepOutput(rid, finish_reason=reason))
                self._finish(seq, reason)
        for rid, error in plan.rejected:
            outputs.append(StepOutput(rid, finish_reason="error", error=error))
        for req in plan.admitted:
            seq = Sequence(req.request_id, list(req.prompt_ids), req.params, self.eos_token_ids,
                           max_len=self.config.max_model_len, arrival=req.arrival)
            self.seqs[seq.request_id] = seq
            self.waiting.append(seq)
        for rid in reversed(plan.preempted):
            seq = self.seqs[rid]
            self.running.remove(seq)
            self._release(seq)
            seq.num_computed = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
            self.num_preemptions += 1
            logger.info("request %s preempted (recompute later)", rid)
        batch = []
        for chunk in plan.batch:
            seq = self.seqs[chunk.request_id]
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SequenceStatus.RUNNING
            need = self._blocks_for(seq.num_computed + chunk.num_tokens) - len(seq.block_table)
            seq.block_table += self.allocator.allocate(max(0, need))
            batch.append((seq, seq.num_computed, chunk.num_tokens))
            seq.num_computed += chunk.num_tokens
        return outputs, batch

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        del self.seqs[seq.request_id]

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []

    def has_work(self) -> bool:
        return bool(self.seqs)
