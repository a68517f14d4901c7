"""Continuous batching with chunked prefill and preemption by recompute.

`plan()` (rank 0 only) is a pure function of the scheduler state and its inputs: it never
mutates anything, so it can be tested without processes. `apply()` (every rank) is the only
place where requests change state and blocks change hands.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.sequence import FinishReason, KVRole, Sequence, SequenceStatus
from pdserve.kvcache import BlockAllocator
from pdserve.logs import about

from .lifecycle import HeldEvent, ended
from .lifecycle import step as held_step
from .plan import (Inbox, NewRequest, SampledToken, ScheduledChunk, StepOutput, StepPlan,
                   TransferOutcome)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # the chunked-prefill token budget of one step
    max_model_len: int = 8192


@dataclass
class _Ends:
    """The planner's projection of what ends this step: requests that leave the queues, the
    blocks that come back, held rooms whose KV landed, and every held request's new status."""

    held: dict[str, SequenceStatus]
    gone: set[str] = field(default_factory=set)
    freed: int = 0
    arrived: list[SampledToken] = field(default_factory=list)


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
        self.seqs: dict[str, Sequence] = {}  # live requests (waiting, running, awaiting their KV)
        self.held: dict[str, Sequence] = {}  # status.held: a KV transfer may touch their blocks
        self.num_preemptions = 0

    # ---- rank 0: decide -------------------------------------------------------------------

    def plan(self, step: int, inbox: Inbox, sampled: list[SampledToken],
             transfers: list[TransferOutcome] = ()) -> StepPlan:
        """The step's decisions, from the state, the inbox, last step's tokens and the transfer
        outcomes agreed this step."""
        plan = StepPlan(step=step, sampled=list(sampled), transfers=list(transfers),
                        shutdown=inbox.shutdown)
        ends = _Ends({rid: seq.status for rid, seq in self.held.items()})
        self._end_sampled(ends, sampled)
        self._end_transfers(ends, transfers)
        plan.aborted = self._end_aborted(ends, inbox.aborts)
        free = self._admit(plan, inbox, self.allocator.num_free + ends.freed)
        plan.batch, plan.preempted = self._schedule(ends.gone, sampled, ends.arrived, plan.admitted, free)
        return plan

    def _end_sampled(self, ends: _Ends, sampled: list[SampledToken]) -> None:
        for s in sampled:
            seq = self.seqs.get(s.request_id)
            reason = seq and seq.stop_reason(s.token_id, len(seq.output_ids) + 1)
            if reason:
                ends.gone.add(s.request_id)
                ends.freed += len(seq.block_table) if ended(reason) is SequenceStatus.FINISHED else 0

    def _end_transfers(self, ends: _Ends, transfers: list[TransferOutcome]) -> None:
        """Held requests move as apply() will move them: by the same table (lifecycle.step)."""
        for t in transfers:
            seq = self.held.get(t.request_id)
            if seq is None or not ends.held[t.request_id].held:
                continue
            move = held_step(ends.held[t.request_id], HeldEvent.of(t.kind))
            ends.held[t.request_id] = move.status
            if move.status is SequenceStatus.RUNNING and not seq.stop_reason(t.token.token_id, 1):
                ends.arrived.append(t.token)
            elif move.status is SequenceStatus.RUNNING or move.frees_blocks:
                ends.freed += len(seq.block_table)  # ran and ended on its first token, or released
                ends.gone.add(t.request_id)

    def _end_aborted(self, ends: _Ends,
                     aborts: list[tuple[str, FinishReason]]) -> list[tuple[str, FinishReason]]:
        """The aborts that end a request this step (others: unknown, or ended already)."""
        out = []
        for rid, reason in aborts:
            status = ends.held.get(rid)
            if rid in ends.gone:
                continue
            if status is None:  # waiting or running (or unknown)
                if rid not in self.seqs:
                    continue
                ends.freed += len(self.seqs[rid].block_table)
            elif status is SequenceStatus.RUNNING:  # its KV landed this step: it ran, now it ends
                ends.arrived = [a for a in ends.arrived if a.request_id != rid]
                ends.freed += len(self.held[rid].block_table)
            elif status.held:
                move = held_step(status, HeldEvent.ABORT)
                if move.finish is None:
                    continue  # ended already: its hold waits for the fence
                ends.held[rid] = move.status
            else:
                continue  # its hold ended this step: nothing left to abort
            out.append((rid, reason))
            ends.gone.add(rid)
        return out

    def _admit(self, plan: StepPlan, inbox: Inbox, free: int) -> int:
        """Admit, reject or defer the new requests; the blocks still free for the batch."""
        seen = set(self.seqs)
        aborted_now = {rid for rid, _ in inbox.aborts}
        for req in inbox.new:
            error = self._admission_error(req, seen)
            if error:
                plan.rejected.append((req.request_id, error))
            elif req.request_id in aborted_now:
                plan.rejected.append((req.request_id, "aborted before it started"))
            elif req.kv is KVRole.DECODE:
                need = self._blocks_for(len(req.prompt_ids))
                if need > free:
                    plan.deferred.append(req)
                    continue
                free -= need
                plan.admitted.append(req)
            else:
                plan.admitted.append(req)
            seen.add(req.request_id)
        return free

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

    def _schedule(self, gone: set[str], sampled: list[SampledToken], arrived: list[SampledToken],
                  admitted: list[NewRequest], free: int) -> tuple[list[ScheduledChunk], list[str]]:
        cfg = self.config
        grown = {s.request_id for s in sampled}
        running: list[_Slot] = [
            _Slot(seq, seq.request_id, seq.num_computed, seq.num_pending + (seq.request_id in grown),
                  len(seq.block_table))
            for seq in self.running if seq.request_id not in gone]
        for tok in arrived:  # decode rooms whose KV landed: the prompt is cached, one token pending
            seq = self.held[tok.request_id]
            running.append(_Slot(seq, seq.request_id, len(seq.prompt_ids), 1, len(seq.block_table)))
        waiting = [_Slot(seq, seq.request_id, 0, seq.num_tokens, 0)
                   for seq in self.waiting if seq.request_id not in gone]
        waiting += [_Slot(None, r.request_id, 0, len(r.prompt_ids), 0) for r in admitted
                    if r.kv is not KVRole.DECODE]

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
            if seq is not None:  # else: aborted after the token was sampled
                outputs.append(self._append(seq, s))
        for t in plan.transfers:
            seq = self.held.get(t.request_id)
            if seq is not None:  # else: the room is not ours (any more): a late or duplicate outcome
                self._move_held(seq, HeldEvent.of(t.kind), outputs, token=t.token, error=t.error)
        for rid, reason in plan.aborted:
            seq = self.held.get(rid)
            if seq is not None:
                self._move_held(seq, HeldEvent.ABORT, outputs, reason=reason)
            elif (seq := self.seqs.get(rid)) is not None:
                outputs.append(StepOutput(rid, finish_reason=reason))
                self._finish(seq, reason)
        for rid, error in plan.rejected:
            outputs.append(StepOutput(rid, finish_reason=FinishReason.ERROR, error=error))
        for req in plan.admitted:
            seq = Sequence(req.request_id, list(req.prompt_ids), req.params, self.eos_token_ids,
                           max_len=self.config.max_model_len, arrival=req.arrival, kv=req.kv)
            self.seqs[seq.request_id] = seq
            if req.kv is KVRole.DECODE:  # blocks now, the KV arrives later
                seq.block_table = self.allocator.allocate(self._blocks_for(len(seq.prompt_ids)))
                seq.status = SequenceStatus.AWAITING_KV
                self.held[seq.request_id] = seq
                outputs.append(StepOutput(seq.request_id, room_blocks=list(seq.block_table)))
            else:
                self.waiting.append(seq)
        for rid in reversed(plan.preempted):
            seq = self.seqs[rid]
            self.running.remove(seq)
            self._release(seq)
            seq.num_computed = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
            self.num_preemptions += 1
            logger.info("request %s preempted (recompute later)", rid, extra=about(rid))
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

    def _append(self, seq: Sequence, s: SampledToken) -> StepOutput:
        seq.output_ids.append(s.token_id)
        if s.logprobs is not None:
            seq.logprobs.append(s.logprobs)
        reason = seq.stop_reason(s.token_id, len(seq.output_ids))
        if reason:
            self._finish(seq, reason)
        return StepOutput(seq.request_id, s.token_id, s.logprobs, reason)

    def _move_held(self, seq: Sequence, event: HeldEvent, outputs: list[StepOutput], *,
                   token: SampledToken | None = None, error: str | None = None,
                   reason: FinishReason = FinishReason.ABORT) -> None:
        """Move a held request by the lifecycle table: its blocks, its queue, its report."""
        move = held_step(seq.status, event)
        seq.status = move.status
        if move.status is SequenceStatus.RUNNING:  # the KV landed: the prompt is cached
            del self.held[seq.request_id]
            seq.num_computed = len(seq.prompt_ids)
            self.running.append(seq)
            outputs.append(self._append(seq, token))
        elif move.status is SequenceStatus.FINISHED:
            del self.held[seq.request_id]
            self._release(seq)
        if move.finish is not None:
            seq.finish_reason = reason if event is HeldEvent.ABORT else move.finish
            why = f"KV transfer failed: {error}" if event is HeldEvent.FAILED else None
            outputs.append(StepOutput(seq.request_id, finish_reason=seq.finish_reason, error=why))
        if move.status is not SequenceStatus.RUNNING:  # ended: only a hold may keep it
            self.seqs.pop(seq.request_id, None)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a running or waiting request. Its blocks return now, unless its KV is still to be
        sent (lifecycle.ended)."""
        seq.finish_reason = reason
        self.seqs.pop(seq.request_id, None)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = ended(reason)
        if seq.status.held:
            self.held[seq.request_id] = seq
        else:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []

    def has_work(self) -> bool:
        return bool(self.seqs or self.held)
