"""The lockstep loop: every rank of a TP group runs observe → agree → broadcast → apply, and
nothing else, so no rank can be in a different collective than another.

1. Observe: rank 0 has drained its inbox; every rank drains its own transfer results.
2. Agree: one fixed-size gather brings every rank's observations to rank 0, which turns inbox,
   observations and its clock into a `StepPlan` (a transfer is complete only when complete on
   every rank, failed when failed on any).
3. Broadcast: one fixed-size broadcast delivers the plan.
4. Apply: every rank applies the plan in the same order and runs the batch; the model's
   collectives follow from the plan alone. Only rank 0 samples; its tokens travel in the next
   step's plan.

Structured outputs follow the same rule: the grammar mask is part of sampling, so grammar
matchers live only where sampling happens, on rank 0 (`Sequence.grammar`, started by the
sampler). Other ranks never build one: they follow rank 0's tokens from the plan, so a
grammar decision cannot differ between ranks, and no rank waits on a grammar compile.

Overlap (`stage_batch` given, `--overlap`): step N's forward runs on a forward thread
(forward_thread.py) while the loop thread observes, agrees, plans and broadcasts step N+1 (and
the caller hands step N's outputs out). The rules that keep the ranks in lockstep:

* The loop is the same sequence on every rank: observe → agree → plan → broadcast → wait for
  forward N → apply N+1 → start forward N+1. The plan is still one fixed-size gather and one
  broadcast. `apply` runs only while no forward does, so nothing a forward reads (block tables,
  output ids, the pool) changes under it, and a block freed by `apply` can no longer be written
  by any forward: blocks of an ended or aborted request come back only after the forward that
  could write them has finished. An abort or a transfer outcome that lands during forward N
  is seen by plan N+1 and takes effect in apply N+1, after forward N: never rank-locally.
* Plan N+1 cannot hold forward N's tokens (not sampled yet): it holds forward N-1's. A decode
  step of a request that forward N samples for takes a placeholder as input; the model runner
  fills it with forward N's token before forward N+1 computes (rank 0 has it; with TP, rank 0
  broadcasts the step's placeholder tokens on the model's process group at the start of the
  forward, on the forward thread, so every rank does it at the same point of its forwards).
  The control collectives (agree, broadcast) then run on another process group than the
  model's: two threads never share one group, whose collectives would interleave differently
  on each rank.
* A finish (EOS, a stop token, max_tokens, a prefill's hand-off) is seen one step late, when
  the token reaches a plan; the scheduler does not take a placeholder for a request that
  certainly ends with it (max_tokens, the context, a prefill's first token), so only an EOS or
  stop token costs an extra row. That extra token reaches a later plan after its request ended
  and `apply` drops it on every rank alike: it never becomes an output.
* A request whose sampling reads its own output (a grammar, penalties, min_tokens) never takes a
  placeholder: it waits one step for its token instead (scheduler.py).
* A forward's tokens become outputs in the plan after next, one step later by count: in time,
  forward N's token is out once forward N+1 has ended. The plain loop hands a step's outputs out
  (`emit`) before its forward, so there forward N's token is out before forward N+1 starts: one
  forward sooner than with overlap.
* The state digest is taken between apply and the forward's start, when neither thread is in
  a collective; the model's and the loop's collectives are traced apart (`Traces`).
* Prefill: a room's first token reaches a plan only after the forward that computed its KV has
  finished, and the KV write starts from that plan's `act`: it never reads a block a forward
  still writes.
"""
from __future__ import annotations

import hashlib
import logging
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.sequence import Sequence

from .forward_thread import ForwardThread
from .plan import Inbox, SampledToken, StepOutput, StepPlan, TransferKind, TransferOutcome
from .recent import RecentIds
from .scheduler import Scheduler

logger = logging.getLogger(__name__)

# One rank's transfer outcomes a step, the rest the next: under TP its observation must fit
# its fixed-size buffer, so half of that bounds their bytes as well (a first token with 20 top
# logprobs pickles to ≈ 480 bytes: 64 of them, a burst of rooms landing on a decode worker, took
# ≈ 30 KB of a 16 KiB buffer).
MAX_OUTCOMES_PER_STEP = 64


@dataclass
class Observation:
    """What one rank saw since the last step."""

    rank: int
    transfers: list[TransferOutcome] = field(default_factory=list)
    digest: dict[str, str] | None = None  # state digest after the previous step (every K steps)
    digest_step: int = -1


@dataclass
class _RoomReports:
    """What each rank reported of one room so far (rank 0's view)."""

    kinds: dict[int, set[TransferKind]] = field(default_factory=dict)
    token: SampledToken | None = None  # rank 0's: only rank 0 samples
    error: str | None = None           # the first failure's
    aborted: bool = False              # the first failure's: the other worker aborted the room
    peer_dead: bool = False            # some rank's failure: the other worker died
    failed: bool = False               # FAILED was agreed (once)


class TransferAgreement:
    """Rank 0's view of every room across ranks: per-rank results → agreed outcomes.

    `settled` remembers rooms already decided, so a rank's late report of one is dropped. It
    is not the abort memory of the engine (requests) nor the room tombstones of a transfer
    agent (one rank's peer messages): it keys the agreement's own decisions, on rank 0."""

    def __init__(self, size: int, remember: int = 100_000):
        self.size = size
        self._rooms: dict[str, _RoomReports] = {}
        self.settled = RecentIds(capacity=remember)

    def add(self, observations: list[Observation]) -> list[TransferOutcome]:
        out: list[TransferOutcome] = []
        touched: list[str] = []
        for obs in observations:
            for t in obs.transfers:
                if t.request_id in self.settled:
                    continue
                room = self._rooms.setdefault(t.request_id, _RoomReports())
                room.kinds.setdefault(obs.rank, set()).add(t.kind)
                if t.kind is TransferKind.ARRIVED and obs.rank == 0:
                    room.token = t.token
                if t.kind is TransferKind.FAILED:
                    # a dead peer also fails a room's pending write locally, untyped: any typed
                    # report before the decision says why
                    room.peer_dead |= t.peer_dead
                    if room.error is None:
                        room.error, room.aborted = f"rank {obs.rank}: {t.error}", t.aborted
                touched.append(t.request_id)
        for rid in dict.fromkeys(touched):
            out += self._decide(rid)
        return out

    def _decide(self, rid: str) -> list[TransferOutcome]:
        room = self._rooms[rid]
        kinds = [room.kinds.get(r, set()) for r in range(self.size)]
        out = []
        if not room.failed and any(TransferKind.FAILED in k for k in kinds):
            room.failed = True
            out.append(TransferOutcome(rid, TransferKind.FAILED, error=room.error, peer_dead=room.peer_dead,
                                       aborted=room.aborted))
        if room.failed or any(TransferKind.FENCED in k for k in kinds):
            if all(k & _LAST_WORDS for k in kinds):  # nothing can write on any rank any more
                out.append(TransferOutcome(rid, TransferKind.FENCED))
                self._end(rid)
        elif all(TransferKind.ARRIVED in k for k in kinds):
            out.append(TransferOutcome(rid, TransferKind.ARRIVED, room.token))
            self._end(rid)
        elif all(TransferKind.WRITTEN in k for k in kinds):
            out.append(TransferOutcome(rid, TransferKind.WRITTEN))
            self._end(rid)
        return out

    def _end(self, rid: str) -> None:
        del self._rooms[rid]
        self.settled.add(rid)


_LAST_WORDS = frozenset({TransferKind.FENCED, TransferKind.ARRIVED, TransferKind.WRITTEN})


def state_digest(scheduler: Scheduler, trace_digest: str) -> dict[str, str]:
    """Per-field digests of the scheduler state: equal on every rank, or the ranks diverged."""
    def h(value: object) -> str:
        return hashlib.blake2b(repr(value).encode(), digest_size=8).hexdigest()
    seqs = sorted(scheduler.seqs.items())
    return {
        "waiting": h([s.request_id for s in scheduler.waiting]),
        "running": h([s.request_id for s in scheduler.running]),
        "held": h(sorted((r, s.status.value, s.finish_reason) for r, s in scheduler.held.items())),
        "progress": h([(r, s.num_computed, len(s.output_ids), scheduler.futures.get(r, 0)) for r, s in seqs]),
        "block_tables": h([(r, s.block_table) for r, s in seqs] +
                          sorted((r, s.block_table) for r, s in scheduler.held.items())),
        "pool": h((scheduler.allocator.num_free, scheduler.allocator.num_used)),
        "cache": scheduler.allocator.digest(),  # holders, LRU order and the prefix index
        "collectives": trace_digest,
    }


def first_divergence(observations: list[Observation]) -> str | None:
    """A message naming the first rank and field whose digest differs from rank 0's, or None."""
    ref = observations[0]
    for obs in observations[1:]:
        if obs.digest is None or ref.digest is None:
            continue
        for name, value in ref.digest.items():
            if obs.digest.get(name) != value:
                return (f"TP ranks diverged: rank {obs.rank} differs from rank 0 in {name!r} "
                        f"after step {ref.digest_step}")
    return None


@dataclass
class StepTimes:
    """The loop's own timers, summed over the steps that ran a forward (seconds): what a worker
    reports on /load (`step_seconds`) and bench/serve.py turns into time per step."""

    steps: int = 0         # steps that ran (plain) or started (overlap) a forward
    forwards: int = 0
    forward: float = 0.0   # the forward and sampling (on the forward thread with overlap)
    plan: float = 0.0      # observe + agree + plan + broadcast (with the transfer polling)
    poll: float = 0.0      # of which: polling the transfers (`link.observe`)
    apply: float = 0.0     # apply, the transfer's act (overlap: + staging the inputs, the hand-off)
    wait: float = 0.0      # overlap: the loop thread waiting for the running forward
    output: float = 0.0    # handing the outputs to their requests (`emit`: the worker's dispatch)
    step: float = 0.0      # the whole step as the loop thread sees it (with `emit`)

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


class TransferLink(Protocol):
    """One rank's transfer, as the loop sees it (engine/kv_link.py; tests pass in their own)."""

    def observe(self) -> list[TransferOutcome]:
        """This rank's transfer results since the last call."""

    def act(self, plan: StepPlan, outputs: list[StepOutput], held: dict[str, Sequence]) -> None:
        """Carry out the plan's transfer decisions on this rank."""


StageBatch = Callable[[list, bool, list[SampledToken]], Callable[[], list[SampledToken]]]


class LockstepLoop:
    """One TP rank's loop body. `run_batch(batch, sample)` runs the forward (all ranks) and
    samples (rank 0 only); `link` is this rank's transfer, if any.

    Overlap: `stage_batch(batch, sample, previous)` is called on the loop thread after apply,
    with rank 0's tokens of the previous forward (to fill placeholders), and returns the job to
    run on the forward thread."""

    def __init__(self, scheduler: Scheduler, comm, run_batch: Callable, link: TransferLink | None = None,
                 digest_every: int = 0, trace=None, stage_batch: StageBatch | None = None):
        self.scheduler, self.comm, self.run_batch, self.link = scheduler, comm, run_batch, link
        self.rank = comm.rank
        self.agreement = TransferAgreement(comm.size)
        self.digest_every = digest_every  # 0: off
        self.trace = trace
        self.sampled: list[SampledToken] = []
        self.step_no = 0
        self._backlog: list[TransferOutcome] = []
        self._digest: dict[str, str] | None = None
        self._digest_step = -1
        self.agree_s = 0.0  # the last step's time in the agree and broadcast collectives
        self.step_s = 0.0
        # the loop's own timers (bench/offline.py): observe+agree+plan+broadcast (of which
        # `poll_s` polls the transfers), the wait for the running forward (overlap), apply, and
        # the forward itself (on the forward thread with overlap)
        self.plan_s = self.poll_s = self.wait_s = self.apply_s = self.forward_s = 0.0
        self.times = StepTimes()  # their sums over the steps with a forward
        self.stage_batch = stage_batch
        self.before_forward: Callable[[], None] | None = None  # a test's hook, on the forward thread
        # rank 0's caller (the worker): hands a step's outputs to their requests as soon as `apply`
        # made them, before the forward runs, so a token reaches its client one forward sooner
        self.emit: Callable[[list[StepOutput]], None] | None = None
        self.output_s = 0.0
        self.emitted_at = 0.0  # when the last step's outputs were handed out (time.monotonic)
        self.waiting_forward = threading.Event()  # set while the loop thread waits for a forward
        self._forward: ForwardThread | None = ForwardThread() if stage_batch else None

    @property
    def overlap(self) -> bool:
        return self._forward is not None

    @property
    def in_flight(self) -> bool:
        """A forward is running (or finished, its tokens not collected yet)."""
        return self._forward is not None and self._forward.busy

    def step(self, inbox: Inbox) -> tuple[StepPlan, list[StepOutput]]:
        """One step: the plain loop, or the overlapped one (module docstring)."""
        if self.overlap:
            return self._step_overlap(inbox)
        t0 = time.perf_counter()
        plan = self._decide(inbox)
        self.plan_s = time.perf_counter() - t0
        outputs, batch = self.scheduler.apply(plan)
        if self.link is not None:
            self.link.act(plan, outputs, self.scheduler.held)
        self.apply_s = time.perf_counter() - t0 - self.plan_s
        self._emit(outputs)
        t1 = time.perf_counter()
        sampled = self.run_batch(batch, self.rank == 0)
        self.forward_s = time.perf_counter() - t1
        self.sampled = sampled if self.rank == 0 else []
        self._check()
        self.step_no += 1
        self.step_s = time.perf_counter() - t0
        if batch:
            self._count(forwards=1, forward=self.forward_s)
        return plan, outputs

    def _emit(self, outputs: list[StepOutput]) -> None:
        self.output_s = 0.0
        self.emitted_at = time.monotonic()
        if outputs and self.emit is not None:
            t0 = time.perf_counter()
            self.emit(outputs)
            self.output_s = time.perf_counter() - t0

    def _count(self, forwards: int = 0, forward: float = 0.0) -> None:
        """Add this step's timers to `times` (a step that ran or started a forward)."""
        t = self.times
        t.steps += 1
        t.forwards += forwards
        t.forward += forward
        t.plan += self.plan_s
        t.poll += self.poll_s
        t.apply += self.apply_s
        t.wait += self.wait_s
        t.output += self.output_s
        t.step += self.step_s

    def _check(self) -> None:
        if self.digest_every and (self.step_no + 1) % self.digest_every == 0:
            if not self.scheduler.has_work():  # checking on: the books balance (cheap only when idle)
                self.scheduler.allocator.check_integrity()
            self._digest = state_digest(self.scheduler, self.trace.digest() if self.trace else "")
            self._digest_step = self.step_no

    def _outcomes_now(self) -> list[TransferOutcome]:
        """This step's share of the backlog: the oldest outcomes, up to the count and byte
        bounds (the first always: one outcome fits, its error text being bounded)."""
        budget = self.comm.observation_bytes // 2 if self.comm.observation_bytes else None
        n = size = 0
        for outcome in self._backlog[:MAX_OUTCOMES_PER_STEP]:
            if budget is not None:
                size += len(pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL))
                if n and size > budget:
                    break
            n += 1
        mine, self._backlog = self._backlog[:n], self._backlog[n:]
        return mine

    def _decide(self, inbox: Inbox) -> StepPlan:
        """Observe, agree, plan (rank 0), broadcast: the plan of this step, on every rank."""
        if self.link is not None:
            t0 = time.perf_counter()
            self._backlog += self.link.observe()
            self.poll_s = time.perf_counter() - t0
        else:
            self.poll_s = 0.0
        obs = Observation(self.rank, self._outcomes_now(), self._digest, self._digest_step)
        self._digest = None
        t1 = time.perf_counter()
        observations = self.comm.agree(obs)
        agree_s = time.perf_counter() - t1
        plan = None
        if self.rank == 0:
            transfers = self.agreement.add(observations)
            plan = self.scheduler.plan(self.step_no, inbox, self.sampled, transfers)
            plan.peer_dead = inbox.peer_dead  # the transfer link fails and fences them on every rank
            error = first_divergence(observations)
            if error:
                logger.error("%s; stopping the worker", error)
                plan.shutdown, plan.error = True, error
        t1 = time.perf_counter()
        if self.comm.size == 1:
            plan = self.comm.broadcast(plan)
        else:  # rank 0 keeps its own plan, logprobs and all
            sent = self.comm.broadcast(plan.for_followers() if self.rank == 0 else None)
            plan = plan if self.rank == 0 else sent
        self.agree_s = agree_s + time.perf_counter() - t1
        return plan

    def _step_overlap(self, inbox: Inbox) -> tuple[StepPlan, list[StepOutput]]:
        """The overlapped step (module docstring): plan N+1 while forward N runs, then wait for
        it, apply N+1 and start forward N+1 on the forward thread."""
        t0 = time.perf_counter()
        plan = self._decide(inbox)  # forward N runs meanwhile
        t1 = time.perf_counter()
        self.plan_s = t1 - t0
        previous = self.finish()  # forward N's tokens: placeholders of N+1, then plan N+2's
        t2 = time.perf_counter()
        self.wait_s = t2 - t1
        self.sampled = previous
        outputs, batch = self.scheduler.apply(plan)
        if self.link is not None:
            self.link.act(plan, outputs, self.scheduler.held)
        self._check()  # no forward runs: every rank's traces are at the same point
        if batch:
            job = self.stage_batch(batch, self.rank == 0, previous)
            self._forward.start(lambda: self._run_forward(job))
        self.apply_s = time.perf_counter() - t2
        self._emit(outputs)  # while forward N+1 runs
        self.step_no += 1
        self.step_s = time.perf_counter() - t0
        if batch:
            self._count()  # the forward counts itself, on its thread
        return plan, outputs

    def _run_forward(self, job: Callable[[], list[SampledToken]]) -> list[SampledToken]:
        if self.before_forward is not None:
            self.before_forward()
        t0 = time.perf_counter()
        sampled = job()
        self.forward_s = time.perf_counter() - t0
        self.times.forwards += 1  # only this thread writes these two
        self.times.forward += self.forward_s
        return sampled

    def finish(self) -> list[SampledToken]:
        """Wait for the running forward (if any); rank 0's tokens of it ([] elsewhere). A failed
        forward raises here, on the loop thread."""
        if not self.in_flight:
            return []
        self.waiting_forward.set()
        try:
            sampled = self._forward.wait()
        finally:
            self.waiting_forward.clear()
        return sampled if self.rank == 0 else []

    def close(self) -> None:
        """Wait for the running forward and stop the forward thread (the loop ends)."""
        try:
            self.finish()
        finally:
            if self._forward is not None:
                self._forward.close()
