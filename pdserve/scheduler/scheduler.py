"""Continuous batching with chunked prefill, a prefix cache, and preemption by recompute.

`plan()` (rank 0 only) is a pure function of the scheduler state and its inputs: it never
mutates anything, so it can be tested without processes. `apply()` (every rank) is the only
place where requests change state and blocks change hands.

Prefix cache, lockstep-safe: the plan says how many tokens each newly scheduled request takes
from the cache (`ScheduledChunk.cached`); every rank then takes exactly that many leading
blocks of the request's chain from its own cache (which is identical on every rank, since it
changes only in `apply`, deterministically), before any block is allocated in the step, so
the blocks the plan counted on cannot be evicted under it. Evictions happen only inside
`BlockAllocator.allocate`, in LRU order: a function of the plan too.

Admission (who starts running) leaves a reserve of one block per running stream for their
growth, and wants the whole prompt's blocks at once; when running streams need blocks anyway,
the most recently admitted is preempted first, and a request alone in the running batch is
never preempted (it waits for held rooms to give blocks back instead). A request's `priority`
(vLLM's; 0 unless the router runs the priority policy) orders both: waiting requests start in
priority order, running ones are served and kept in it (the smaller first; arrival order among
equals), so a preemption takes the newest of the largest priority, never one of a smaller
priority than the request that needs the blocks. A waiting request that finds no running slot
or no blocks preempts running ones of a larger priority, where that lets it start
(`_displace`, vLLM's and SGLang's priority preemption); with one priority nothing changes.
A decode room that finds too few free blocks for its KV preempts running requests of a larger
priority the same way (`_room_victims`), or waits.
A decode worker's rooms join the running ones as their KV lands, past `max_num_seqs` too (their
blocks are taken already); a step runs only the first `max_num_seqs` of them in that order, so
the rest wait for a slot with their KV, and the first token the prefill worker sampled goes out
in the room's first step (`unsent`), so the wait is time to first token, not a pause after it.

Step budget (`_Budget`, docs/step-budget.md): a step computes at most
`max_num_batched_tokens` tokens; if any request samples in it (a decode, or a prompt's last
chunk), at most `max_prefill_tokens` of them only for their KV (prompt tokens but the last),
so that its token is not held back by a long step; once a prompt's last chunk is in it, at
most `first_token_slack` more prompt tokens, so that prompts ready together get their first
tokens one after another. Running requests come first, then waiting prompts in order, each
chunked to what is left.

Follow-ups (`Inbox.follow_up_wait`, follow_ups.py): when rank 0 expects a finished request's
next turn, a plan that hands out a last token and would run decodes alone holds them back (an
empty batch, `StepPlan.follow_up_wait`); rank 0 waits for the turn before the next plan, so the
turn runs beside those decodes instead of behind another session's prompt step.

Overlap (`SchedulerConfig.overlap`, scheduler/lockstep.py): a plan is made while the previous
step's forward still runs, so a request's newest token may not be known yet. `futures` counts,
per request, the tokens a forward samples (or sampled) that no plan has delivered yet; a
decode step may take the one the running forward samples as its input (a placeholder the model
runner fills in), unless the request certainly ends with it, or its sampling reads its own
output (grammar, penalties, min_tokens), which must then be complete.
"""
from __future__ import annotations

import copy
import logging
from collections import deque
from dataclasses import dataclass, field

from pdserve.block_names import BlockHash, extend_hashes, request_salt
from pdserve.engine.sequence import FinishReason, KVRole, Sequence, SequenceStatus
from pdserve.kvcache import BlockAllocator, Tail
from pdserve.logs import about
from pdserve.engine.sampling_params import SamplingParams

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
    cache_salt: bytes = b""  # starts every block-name chain (block_names.py: salt_of)
    overlap: bool = False  # plans are made while the previous forward runs (see above)
    # of max_num_batched_tokens, the most a step in which a request samples (a decode, a
    # prompt's last chunk) computes only for their KV (prompt tokens, bar the last): bounds
    # the wait for a token (`_Budget`, docs/step-budget.md); None: max_num_batched_tokens only
    max_prefill_tokens: int | None = None
    # once a prompt's last chunk (n > 1 tokens: it samples the prompt's first output) is in a
    # step, the most prompt tokens the step takes after it (`_Budget`); None: no such bound
    first_token_slack: int | None = None


class _Books:
    """The planner's projection of the allocator: blocks an allocation could have (`free`)
    after this step's releases and cache hits, counted as `apply` will count them."""

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.free = allocator.num_free
        self._delta: dict[int, int] = {}  # block → holders gained (+) or dropped (-) this step
        self.taken: set[int] = set()  # cached blocks the plan gives requests (a tail goes to one)

    def _refs(self, b: int) -> int:
        return self.allocator.refcount(b) + self._delta.get(b, 0)

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._delta[b] = self._delta.get(b, 0) - 1
            if self._refs(b) == 0:  # its last holder: empty or cached, either way allocatable
                self.free += 1

    def take_cost(self, blocks: list[int]) -> int:
        """Allocatable blocks that taking these cached blocks uses up (those nobody holds)."""
        return sum(1 for b in blocks if self._refs(b) == 0)

    def take(self, blocks: list[int]) -> None:
        self.free -= self.take_cost(blocks)
        self.taken.update(blocks)
        for b in blocks:
            self._delta[b] = self._delta.get(b, 0) + 1

    def trial(self) -> _Books:
        """A copy to try decisions on; this one is left as it is."""
        other = copy.copy(self)
        other._delta, other.taken = dict(self._delta), set(self.taken)
        return other


@dataclass
class _Ends:
    """The planner's projection of what ends this step: requests that leave the queues, the
    blocks that come back, held rooms whose KV landed, and every held request's new status."""

    held: dict[str, SequenceStatus]
    books: _Books
    gone: set[str] = field(default_factory=set)
    arrived: list[SampledToken] = field(default_factory=list)
    finished: int = 0  # requests whose last token this step hands out (not a prefill's hand-off)


@dataclass
class _Budget:
    """One step's tokens (docs/step-budget.md): `tokens` left of max_num_batched_tokens; of the
    tokens computed only for their KV (`kv`: a prompt chunk's, bar the last prompt token, which
    is sampled from), at most `cap` once a request samples in the step (a decode, or a prompt's
    last chunk): that bounds the wait for its token. A step where none samples spends them all.

    Once a prompt's last chunk of more than one token is in the step, the chunks of more than
    one token after it take at most `slack` tokens in all (`slack_left`): each would hold that
    prompt's first token back by its whole cost, while waiting a step costs it only a step's
    fixed part, so prompts that arrive together start one after another."""

    tokens: int
    cap: int | None
    samples: bool
    slack: int | None = None
    kv: int = 0
    slack_left: int | None = None  # counting once a prompt's first token is in the step

    def chunk(self, pending: int) -> int:
        """How many of a request's `pending` tokens this step takes (0: none)."""
        n = min(pending, self.tokens)
        if pending > 1 and self.slack_left is not None:  # a decode is never held back by it
            n = min(n, self.slack_left)
        if self.cap is None:
            return n
        if n == pending:  # it samples: then the step's tokens for the KV must be within the cap
            if self.kv + n - 1 <= self.cap:
                return n
            n -= 1  # its last token (and its first output) waits for a step that is short enough
        return min(n, max(0, self.cap - self.kv)) if self.samples else n

    def take(self, n: int, pending: int) -> None:
        self.tokens -= n
        self.kv += n - (n == pending)
        self.samples |= n == pending
        if pending > 1 and self.slack_left is not None:
            self.slack_left -= n
        elif n == pending > 1 and self.slack is not None:
            self.slack_left = self.slack


@dataclass
class _Slot:
    """The planner's projection of one request after this step's events."""

    seq: Sequence | None
    request_id: str
    num_computed: int
    num_pending: int
    blocks: list[int]
    prompt: list[int] | None = None  # an admitted request not yet a Sequence
    salt: BlockHash = b""  # an admitted request's chain start (a Sequence's comes from its params)
    priority: int = 0      # the request's: lower starts sooner and is preempted later
    computes_all: bool = False  # wants its prompt's logprobs: every position computed, no cache hit


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
        self.futures: dict[str, int] = {}  # overlap: tokens sampled or being sampled, not yet applied
        self.unsent: dict[str, StepOutput] = {}  # landed rooms' first tokens: out with their first step

    # ---- rank 0: decide -------------------------------------------------------------------

    def plan(self, step: int, inbox: Inbox, sampled: list[SampledToken],
             transfers: list[TransferOutcome] = ()) -> StepPlan:
        """The step's decisions, from the state, the inbox, last step's tokens and the transfer
        outcomes agreed this step."""
        plan = StepPlan(step=step, sampled=list(sampled), transfers=list(transfers),
                        shutdown=inbox.shutdown, reset_cache=inbox.reset_cache)
        ends = _Ends({rid: seq.status for rid, seq in self.held.items()}, _Books(self.allocator))
        self._end_sampled(ends, sampled)
        self._end_transfers(ends, transfers)
        plan.aborted = self._end_aborted(ends, inbox.aborts)
        for_rooms = self._admit(plan, inbox, ends)
        plan.batch, plan.preempted = self._schedule(ends.gone, sampled, ends.arrived, plan.admitted,
                                                    ends.books, for_rooms)
        if inbox.follow_up_wait and self._holds_for_follow_up(plan, ends):
            plan.batch, plan.follow_up_wait = [], inbox.follow_up_wait
        return plan

    def _holds_for_follow_up(self, plan: StepPlan, ends: _Ends) -> bool:
        """The plan hands a request its last token and would run decodes alone (nothing new,
        no prompt waiting or part-computed, no landed room): they can wait for that request's
        next turn, which then runs in their step instead of queueing behind another's (follow_ups.py)."""
        if not ends.finished or plan.admitted or plan.preempted or ends.arrived or self.waiting:
            return False
        rows = [self.seqs[c.request_id] for c in plan.batch]
        return bool(rows) and all(seq.num_computed >= len(seq.prompt_ids) for seq in rows)

    def _end_sampled(self, ends: _Ends, sampled: list[SampledToken]) -> None:
        for s in sampled:
            seq = self.seqs.get(s.request_id)
            reason = seq and seq.stop_reason(s.token_id, len(seq.output_ids) + 1)
            if reason:
                ends.gone.add(s.request_id)
                if ended(reason) is SequenceStatus.FINISHED:
                    ends.books.release(seq.block_table)
                    ends.finished += 1

    def _end_transfers(self, ends: _Ends, transfers: list[TransferOutcome]) -> None:
        """Held requests move as apply() will move them: by the same table (lifecycle.step)."""
        for t in transfers:
            seq = self.held.get(t.request_id)
            if seq is None or not ends.held[t.request_id].held:
                continue
            move = held_step(ends.held[t.request_id], HeldEvent.of(t))
            ends.held[t.request_id] = move.status
            if move.status is SequenceStatus.RUNNING and not seq.stop_reason(t.token.token_id, 1):
                ends.arrived.append(t.token)
            elif move.status is SequenceStatus.RUNNING or move.frees_blocks:
                ends.books.release(seq.block_table)  # ran and ended on its first token, or released
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
                ends.books.release(self.seqs[rid].block_table)
            elif status is SequenceStatus.RUNNING:  # its KV landed this step: it ran, now it ends
                ends.arrived = [a for a in ends.arrived if a.request_id != rid]
                ends.books.release(self.held[rid].block_table)
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

    def _admit(self, plan: StepPlan, inbox: Inbox, ends: _Ends) -> list[str]:
        """Admit, reject or defer the new requests (a decode room takes its blocks now, from
        running requests of a larger priority where it must: their ids, to preempt)."""
        seen = set(self.seqs)
        aborted_now = dict(inbox.aborts)
        books, victims = ends.books, []
        for req in inbox.new:
            error = self._admission_error(req, seen)
            if error:
                plan.rejected.append((req.request_id, error))
            elif req.request_id in aborted_now:  # its client left already: aborted, not failed
                plan.cancelled.append((req.request_id, aborted_now[req.request_id]))
            elif req.kv is KVRole.DECODE:
                hit = self._room_hit(req)
                need = self._blocks_for(len(req.prompt_ids)) - len(hit)
                mine = self._room_victims(req.params.priority, need, hit, books, ends.gone | set(victims))
                if mine is None:
                    plan.deferred.append(req)
                    continue
                for seq in mine:
                    books.release(seq.block_table)
                    victims.append(seq.request_id)
                books.take(hit)
                books.free -= need
                if hit:
                    plan.room_hits[req.request_id] = len(hit)
                plan.admitted.append(req)
            else:
                plan.admitted.append(req)
            seen.add(req.request_id)
        return victims

    def _room_victims(self, priority: int, need: int, hit: list[int], books: _Books, gone: set[str]
                      ) -> list[Sequence] | None:
        """What a decode room of `priority` that needs `need` new blocks and the cached `hit`
        preempts: running requests of a larger priority, the newest of the largest first (as
        `_displace` takes them), only as many as let it fit; [] when it fits, None when it
        cannot (then it waits, and nothing is preempted for it)."""
        if need + books.take_cost(hit) <= books.free:
            return []
        trial = books.trial()
        running = sorted((seq for seq in self.running if seq.request_id not in gone),
                         key=lambda seq: seq.params.priority)
        mine = []
        while running and running[-1].params.priority > priority:
            mine.append(running.pop())
            trial.release(mine[-1].block_table)
            if need + trial.take_cost(hit) <= trial.free:
                return mine
        return None

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

    def _room_hit(self, req: NewRequest) -> list[int]:
        """A decode room's cached blocks: the longest cached chain of its prompt's full blocks
        (KV this worker kept from earlier requests). The prefill worker writes only the rest."""
        bs, prompt = self.config.block_size, req.prompt_ids
        names = extend_hashes([], prompt[:len(prompt) // bs * bs], bs, self._salt(req.params))
        return self.allocator.lookup(names)

    def _salt(self, params: SamplingParams) -> BlockHash:
        """Where a request's chain of block names starts (`request_salt`)."""
        return request_salt(self.config.cache_salt, params.cache_salt)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _names(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The names of `seq`'s first `num_blocks` full blocks (kept on the sequence, extended
        as it grows: its tokens before the last named block never change)."""
        if len(seq.block_hashes) < num_blocks:
            bs = self.config.block_size
            extend_hashes(seq.block_hashes, seq.token_ids[:num_blocks * bs], bs, self._salt(seq.params))
        return seq.block_hashes[:num_blocks]

    def _cache_hit(self, slot: _Slot, books: _Books) -> tuple[list[int], int]:
        """What a request starting from nothing can reuse, leaving at least its last token to
        compute (its logits): the longest cached chain of its full blocks, the host tier's
        continuation of it, then a tail that holds the next few tokens (when the chain ended
        on the device). Returns the device blocks to take (a tail last) and the tokens cached.
        A request that wants its prompt's logprobs takes nothing (its logits are computed at
        every position); it still names its blocks for others."""
        if not self.allocator.caching or slot.num_computed or slot.computes_all:
            return [], 0
        bs = self.config.block_size
        last = slot.num_pending - 1  # the cache may give the tokens before this one
        if slot.seq is None:
            tokens, salt = slot.prompt, slot.salt
            names = extend_hashes([], tokens[:last // bs * bs], bs, salt)
        else:
            tokens, salt = slot.seq.token_ids, self._salt(slot.seq.params)
            names = self._names(slot.seq, last // bs)
        hit = self.allocator.lookup(names)
        from_host = self.allocator.host_chain(names[len(hit):])
        cached = (len(hit) + from_host) * bs
        if not from_host:
            parent = names[len(hit) - 1] if hit else salt
            block, matched = self.allocator.find_tail(parent, tokens[cached:last], books.taken)
            if matched:
                hit, cached = hit + [block], cached + matched
        return hit, cached

    def _schedule(self, gone: set[str], sampled: list[SampledToken], arrived: list[SampledToken],
                  admitted: list[NewRequest], books: _Books, for_rooms: list[str]
                  ) -> tuple[list[ScheduledChunk], list[str]]:
        """The step's batch, and the running requests it preempts: `for_rooms` (their blocks
        released already, taken by decode rooms), then by priority, then for want of blocks."""
        cfg = self.config
        grown = {s.request_id for s in sampled}
        out = gone | set(for_rooms)
        running: list[_Slot] = [
            _Slot(seq, seq.request_id, seq.num_computed, self._pending(seq, grown), seq.block_table,
                  priority=seq.params.priority)
            for seq in self.running if seq.request_id not in out]
        for tok in arrived:  # decode rooms whose KV landed: the prompt is cached, one token pending
            seq = self.held[tok.request_id]
            running.append(_Slot(seq, seq.request_id, len(seq.prompt_ids), 1, seq.block_table,
                                 priority=seq.params.priority))
        late = grown if self.config.overlap else set()  # overlap: a preempted request's last token
        waiting = [_Slot(seq, seq.request_id, 0, seq.num_tokens + (seq.request_id in late), [],
                         priority=seq.params.priority, computes_all=seq.wants_prompt_logprobs)
                   for seq in self.waiting if seq.request_id not in gone and not self._unresolved(seq, grown)]
        waiting += [_Slot(None, r.request_id, 0, len(r.prompt_ids), [], r.prompt_ids, salt=self._salt(r.params),
                          priority=r.params.priority, computes_all=r.params.prompt_logprobs is not None)
                    for r in admitted if r.kv is not KVRole.DECODE]
        # vLLM's priority: the smaller first, in the order they came among equals (stable sorts);
        # the last running slot is the first preempted
        running.sort(key=lambda s: s.priority)
        waiting.sort(key=lambda s: s.priority)

        batch: list[ScheduledChunk] = []
        preempted = for_rooms + self._displace(running, waiting, books)
        displaced = len(preempted)
        # at most max_num_seqs run (more only where a decode worker's rooms landed: module docstring)
        budget = _Budget(cfg.max_num_batched_tokens, cfg.max_prefill_tokens,
                         samples=any(s.num_pending == 1 for s in running[:cfg.max_num_seqs]),
                         slack=cfg.first_token_slack)
        scheduled: set[str] = set()
        while running and budget.tokens > 0 and len(scheduled) < cfg.max_num_seqs:
            slot = next((s for s in running if s.request_id not in scheduled), None)
            if slot is None:
                break
            n = budget.chunk(slot.num_pending)
            scheduled.add(slot.request_id)
            need = self._blocks_for(slot.num_computed + n) - len(slot.blocks)
            stalled = False
            while need > books.free:  # preempt the newest of the largest priority (recomputed later)
                if len(running) == 1 and running[0] is slot:  # alone: preempting it frees nothing another could use
                    stalled = True
                    break
                victim = running.pop()
                books.release(victim.blocks)
                preempted.append(victim.request_id)
                if victim is slot:
                    break
            if stalled or slot.request_id in preempted or n == 0:
                continue
            books.free -= need
            budget.take(n, slot.num_pending)
            batch.append(ScheduledChunk(slot.request_id, n))
        if len(preempted) == displaced:  # no running stream went short of blocks
            num_running = len(running)
            for slot in waiting:
                if budget.tokens <= 0 or num_running >= cfg.max_num_seqs:
                    break
                hit, cached = self._cache_hit(slot, books)  # host copies need device blocks too
                n = budget.chunk(slot.num_pending - cached)
                if n == 0:  # the budget for prompts is spent: they start in order
                    break
                # the whole prompt's blocks (and its first output's), plus one block of growth
                # for every running stream, or it waits: admitting it must not preempt them
                whole = self._blocks_for(slot.num_pending + 1) - len(hit)
                if whole + books.take_cost(hit) + num_running > books.free:
                    break
                books.take(hit)
                books.free -= self._blocks_for(cached + n) - len(hit)
                budget.take(n, slot.num_pending - cached)
                num_running += 1
                batch.append(ScheduledChunk(slot.request_id, n, cached))
        return batch, preempted

    def _displace(self, running: list[_Slot], waiting: list[_Slot], books: _Books) -> list[str]:
        """Priority preemption (vLLM's and SGLang's): waiting requests, in order, that cannot start
        for want of a running slot (`max_num_seqs`) or of blocks preempt running ones of a larger
        priority, the newest of the largest first, and only where that lets them start. Takes
        the victims out of `running` and releases their blocks in `books`; returns their ids."""
        if not running or not waiting or running[-1].priority <= waiting[0].priority:
            return []  # the common case: one priority, or the waiting ones rank below
        trial, kept, victims, started = books.trial(), list(running), [], 0
        for slot in waiting:  # as the admission loop will take them, counted the same way
            hit, _ = self._cache_hit(slot, trial)
            whole = self._blocks_for(slot.num_pending + 1) - len(hit)

            def short() -> bool:
                running_now = len(kept) + started
                return (running_now >= self.config.max_num_seqs
                        or whole + trial.take_cost(hit) + running_now > trial.free)

            mine = []
            while short() and kept and kept[-1].priority > slot.priority:
                mine.append(kept.pop())
                trial.release(mine[-1].blocks)
            if short():
                break  # it cannot start even so: it, and those after it, wait (none preempted for them)
            trial.take(hit)
            trial.free -= whole
            started += 1
            victims += mine
        for victim in victims:
            running.remove(victim)
            books.release(victim.blocks)
        return [v.request_id for v in victims]

    def _unresolved(self, seq: Sequence, grown: set[str]) -> int:
        """Overlap: tokens of `seq` the running forward samples (not in this plan); 0 otherwise."""
        if not self.config.overlap:
            return 0
        return max(0, self.futures.get(seq.request_id, 0) - (seq.request_id in grown))

    def _pending(self, seq: Sequence, grown: set[str]) -> int:
        """Tokens of a running request to compute this step, a running forward's token included
        (overlap) unless the request certainly ends with that token or samples from its output."""
        known = seq.num_pending + (seq.request_id in grown)
        unresolved = self._unresolved(seq, grown)
        if not unresolved:
            return known
        outputs = len(seq.output_ids) + (seq.request_id in grown) + unresolved
        if _certain_end(seq, outputs) or _reads_output(seq):
            return known  # 0: it waits until its token is known
        return known + unresolved

    # ---- every rank: apply ----------------------------------------------------------------

    def apply(self, plan: StepPlan) -> tuple[list[StepOutput], list[tuple[Sequence, int, int]]]:
        """Apply a plan; returns the outputs to emit and the batch as (seq, start, num_tokens)."""
        outputs: list[StepOutput] = []
        for s in plan.sampled:
            seq = self.seqs.get(s.request_id)
            if seq is not None:  # else: aborted after the token was sampled (or, overlap: ended)
                if not self.config.overlap:
                    outputs.append(self._append(seq, s))
                    continue
                self._resolve(seq)
                outputs.append(self._append(seq, s))
                if seq.finish_reason is None:  # a block whose last token was a placeholder is named now
                    self._name_full_blocks(seq)
        for t in plan.transfers:
            seq = self.held.get(t.request_id)
            if seq is not None:  # else: the room is not ours (any more): a late or duplicate outcome
                self._move_held(seq, HeldEvent.of(t), outputs, token=t.token, error=t.error,
                                peer_dead=t.peer_dead)
        for rid, reason in plan.aborted:
            seq = self.held.get(rid)
            if seq is not None:
                self._move_held(seq, HeldEvent.ABORT, outputs, reason=reason)
            elif (seq := self.seqs.get(rid)) is not None:
                if (first := self.unsent.pop(rid, None)) is not None:  # a room's token comes before its end
                    outputs.append(first)
                outputs.append(StepOutput(rid, finish_reason=reason, cached_tokens=seq.cached_tokens))
                self._finish(seq, reason)
        for rid, error in plan.rejected:
            outputs.append(StepOutput(rid, finish_reason=FinishReason.ERROR, error=error))
        for rid, reason in plan.cancelled:
            outputs.append(StepOutput(rid, finish_reason=reason))
        rooms = []
        for req in plan.admitted:
            seq = Sequence(req.request_id, list(req.prompt_ids), req.params, self.eos_token_ids,
                           max_len=self.config.max_model_len, arrival=req.arrival, kv=req.kv)
            self.seqs[seq.request_id] = seq
            if req.kv is KVRole.DECODE:
                rooms.append(seq)
            else:
                self.waiting.append(seq)
        for rid in reversed(plan.preempted):
            seq = self.seqs[rid]
            self.running.remove(seq)
            self._release(seq)
            seq.num_computed = 0
            seq.num_named = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
            self.num_preemptions += 1
            logger.info("request %s preempted (recompute later)", rid, extra=about(rid))
        # cache hits before any allocation of the step: nothing can evict what the plan counted
        # on (device blocks are held, host copies pinned until they are loaded)
        loads = [(chunk, self._reuse(self.seqs[chunk.request_id], chunk.cached))
                 for chunk in plan.batch if chunk.cached]
        # rooms: blocks now, the KV arrives later; every room's cached blocks are held before any
        # is allocated (an allocation may evict a cached block another room counts on)
        for seq in rooms:
            seq.block_table = self._take_room_hit(seq, plan.room_hits.get(seq.request_id, 0))
        for seq in rooms:
            cached = len(seq.block_table)
            seq.block_table += self.allocator.allocate(self._blocks_for(len(seq.prompt_ids)) - cached)
            seq.status = SequenceStatus.AWAITING_KV
            self.held[seq.request_id] = seq
            outputs.append(StepOutput(seq.request_id, room_blocks=seq.block_table[cached:], room_cached=cached))
        for chunk, names in loads:
            seq = self.seqs[chunk.request_id]
            if names:
                seq.block_table += self.allocator.load(names)
                self.allocator.host.unpin(names)
                self.allocator.num_host_hits += len(names) * self.config.block_size
            seq.num_computed = seq.num_named = chunk.cached
        batch = []
        for chunk in plan.batch:
            seq = self.seqs[chunk.request_id]
            if (first := self.unsent.pop(chunk.request_id, None)) is not None:
                outputs.append(first)
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SequenceStatus.RUNNING
                if seq.cached_tokens is None:  # its first schedule: what the cache gave it
                    seq.cached_tokens = chunk.cached
                    if self.allocator.caching:
                        self.allocator.count_query(len(seq.prompt_ids), chunk.cached)
            need = self._blocks_for(seq.num_computed + chunk.num_tokens) - len(seq.block_table)
            seq.block_table += self.allocator.allocate(max(0, need))
            batch.append((seq, seq.num_computed, chunk.num_tokens))
            seq.num_computed += chunk.num_tokens
            if self.config.overlap and seq.num_computed >= seq.num_tokens:  # it samples a token
                self.futures[seq.request_id] = self.futures.get(seq.request_id, 0) + 1
            self._name_full_blocks(seq)
        if plan.reset_cache:
            self.allocator.forget()
        return outputs, batch

    def _reuse(self, seq: Sequence, cached: int) -> list[BlockHash]:
        """Take the plan's cache hit, the first `cached` tokens of the chain: hold its device
        blocks now (and take the tail that holds the tokens after the last full block); return
        the names to load from the host tier (pinned until then)."""
        bs = self.config.block_size
        n, partial = divmod(cached, bs)
        if seq.num_computed or seq.block_table:
            raise RuntimeError(f"request {seq.request_id}: a cache hit for a request with KV")
        names = self._names(seq, n)
        blocks = self.allocator.lookup(names)[:n]
        rest = names[len(blocks):]
        tail, matched = -1, 0
        if partial and not rest:
            parent = names[-1] if names else self._salt(seq.params)
            tail, matched = self.allocator.find_tail(parent, seq.token_ids[n * bs:cached])
        if self.allocator.host_chain(rest) != len(rest) or matched != partial:  # not rank 0's cache
            raise RuntimeError(f"request {seq.request_id}: the plan reuses {cached} cached tokens, "
                               f"this rank's cache holds {len(blocks)} blocks (+ host copies) and a "
                               f"tail of {matched}")
        self.allocator.acquire(blocks)
        if partial:
            self.allocator.take_tail(tail)
            blocks = blocks + [tail]
        if rest:
            self.allocator.host.pin(rest)
        seq.block_table = blocks
        return rest

    def _take_room_hit(self, seq: Sequence, n: int) -> list[int]:
        """Hold the plan's `n` cached leading blocks of a decode room (named already, never
        written by the transfer, which fills only the blocks after them)."""
        if not self.allocator.caching:
            return []
        blocks = self.allocator.lookup(self._names(seq, n))[:n]
        if len(blocks) != n:
            raise RuntimeError(f"room {seq.request_id}: the plan reuses {n} cached blocks, "
                               f"this rank's cache holds {len(blocks)}")
        self.allocator.acquire(blocks)
        self.allocator.count_query(len(seq.prompt_ids), n * self.config.block_size)
        seq.num_named = n * self.config.block_size
        return blocks

    def _name_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks this step fills, so later requests can reuse them. The KV is written
        by this step's forward, before any later step's plan can look the names up; a decode
        room's prompt blocks, once its KV has landed (before that it computed nothing)."""
        if not self.allocator.caching:
            return
        # overlap: a placeholder's token is unknown until a plan delivers it; name its block then
        full = min(seq.num_computed, seq.num_tokens) // self.config.block_size
        if full * self.config.block_size <= seq.num_named:
            return
        names = self._names(seq, full)
        for i in range(seq.num_named // self.config.block_size, full):
            self.allocator.register(seq.block_table[i], names[i])
        seq.num_named = full * self.config.block_size

    def _append(self, seq: Sequence, s: SampledToken) -> StepOutput:
        seq.output_ids.append(s.token_id)
        reason = seq.stop_reason(s.token_id, len(seq.output_ids))
        if reason:
            self._finish(seq, reason)
        out = StepOutput(seq.request_id, s.token_id, s.logprobs, reason,
                         cached_tokens=seq.cached_tokens if reason else None)
        if len(seq.output_ids) == 1 and seq.prompt_logprobs:  # rank 0's, from the model runner
            out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, []
        return out

    def _move_held(self, seq: Sequence, event: HeldEvent, outputs: list[StepOutput], *,
                   token: SampledToken | None = None, error: str | None = None, peer_dead: bool = False,
                   reason: FinishReason = FinishReason.ABORT) -> None:
        """Move a held request by the lifecycle table: its blocks, its queue, its report."""
        move = held_step(seq.status, event)
        seq.status = move.status
        if move.status is SequenceStatus.RUNNING:  # the KV landed: the prompt is cached
            del self.held[seq.request_id]
            seq.num_computed = len(seq.prompt_ids)
            seq.cached_tokens = token.cached_tokens  # what the prefill worker reused
            self._name_full_blocks(seq)  # its prompt's KV is in place: later rooms may reuse it
            self.running.append(seq)
            out = self._append(seq, token)
            if out.finish_reason is None:  # out when the room first runs: past the slots, it waits
                self.unsent[seq.request_id] = out
            else:
                outputs.append(out)
        elif move.status is SequenceStatus.FINISHED:
            del self.held[seq.request_id]
            self._release(seq)
        if move.finish is not None:
            seq.finish_reason = reason if event is HeldEvent.ABORT else move.finish
            # a plan's abort has no error; the other worker's abort of the room says so
            why = f"KV transfer failed: {error}" if event is HeldEvent.FAILED else error
            outputs.append(StepOutput(seq.request_id, finish_reason=seq.finish_reason, error=why,
                                      peer_dead=peer_dead and event is HeldEvent.FAILED,
                                      cached_tokens=seq.cached_tokens))
        if move.status is not SequenceStatus.RUNNING:  # ended: only a hold may keep it
            self.seqs.pop(seq.request_id, None)
            self.futures.pop(seq.request_id, None)

    def _resolve(self, seq: Sequence) -> None:
        n = self.futures.pop(seq.request_id, 0) - 1
        if n > 0:
            self.futures[seq.request_id] = n

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a running or waiting request. Its blocks return now, unless its KV is still to be
        sent (lifecycle.ended). Overlap: a token still being sampled for it is dropped when it
        comes (it is no longer in `seqs`)."""
        seq.finish_reason = reason
        self.seqs.pop(seq.request_id, None)
        self.futures.pop(seq.request_id, None)
        self.unsent.pop(seq.request_id, None)
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
        """Drop the request's hold on its blocks: cached ones stay cached for others (and
        whoever else holds a block keeps it), never written or evicted while held; its partly
        filled last block stays as a tail."""
        self.allocator.free(seq.block_table, self._tail(seq))
        seq.block_table = []
        if seq.grammar is not None:  # ended or preempted: a recompute replays its output into a new one
            seq.grammar.release()
            seq.grammar = None

    def _tail(self, seq: Sequence) -> Tail | None:
        """The partly filled block after `seq`'s full ones, as the cache may keep it: the tokens
        whose KV is in it (overlap: not a token still being sampled)."""
        if not self.allocator.caching:
            return None
        full, partial = divmod(min(seq.num_computed, seq.num_tokens), self.config.block_size)
        if not partial or len(seq.block_table) <= full:
            return None
        parent = self._names(seq, full)[-1] if full else self._salt(seq.params)
        start = full * self.config.block_size
        return Tail(seq.block_table[full], parent, tuple(seq.token_ids[start:start + partial]))

    def has_work(self) -> bool:
        return bool(self.seqs or self.held)

    def load(self) -> tuple[int, int]:
        """(running, waiting) as reported: a decode worker's landed rooms past `max_num_seqs`
        wait for a slot (`_schedule`) with the waiting queue."""
        running = min(len(self.running), self.config.max_num_seqs)
        return running, len(self.running) - running + len(self.waiting)


def _certain_end(seq: Sequence, num_outputs: int) -> bool:
    """The request ends with its `num_outputs`-th token, whatever that token is."""
    return (seq.kv is KVRole.PREFILL or num_outputs >= seq.params.max_tokens
            or len(seq.prompt_ids) + num_outputs >= seq.max_len)


def _reads_output(seq: Sequence) -> bool:
    """Its sampling reads its own output (sampler.py): the output must be complete first."""
    p = seq.params
    return (p.structured is not None or p.repetition_penalty != 1.0 or bool(p.presence_penalty)
            or bool(p.frequency_penalty) or len(seq.output_ids) < p.min_tokens)
