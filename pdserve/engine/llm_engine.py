"""The engine of one TP rank: observe → agree → broadcast → apply (scheduler/lockstep.py);
with `EngineConfig.overlap`, the next step is planned while the forward runs.

`step()` is the whole loop body: drain the inbox, let the scheduler plan, apply the plan, run
the batch. Tokens sampled in a step travel in the next step's plan, so that with tensor
parallelism, rank 0's sampling reaches every rank through the same single broadcast.
"""
from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import Future

import torch

import pdserve_kernels as ops
from pdserve.distributed import TPGroup
from pdserve.distributed.comm import LocalComm
from pdserve.distributed.trace import CollectiveTrace, Traces
from pdserve.kvcache import BlockAllocator, BlockHash, HostTier, KVPool, salt_of
from pdserve.layers.dsa import INDEX_DTYPES
from pdserve.models import eos_token_ids, load_model, multiplies_natively, read_config
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig, StepOutput, StepPlan
from pdserve.scheduler.follow_ups import FollowUps
from pdserve.scheduler.lockstep import LockstepLoop
from pdserve.scheduler.plan import KVPeer, PeerDeadRooms
from pdserve.scheduler.recent import RecentIds
from pdserve.structured.factory import grammars_for_model
from pdserve.weights import resolve_model_path

from . import cuda_graphs
from .config import EngineConfig, fit_context
from .kv_link import KVLink
from .model_runner import ModelRunner
from .sampling_params import SamplingParams
from .threads import apply_threads
from .sequence import FinishReason, KVRole

logger = logging.getLogger(__name__)


ABORT_TOMBSTONE_TTL_S = 300.0
MAX_PEER_DEAD_PER_STEP = 256  # rooms of a dead peer per plan (a plan travels in a fixed-size buffer)


class LLMEngine:
    """Continuous-batching engine over one model, on token ids; thread-safe `add_request` / `abort`.

    `kv_role`: LOCAL (prefill and decode here), PREFILL or DECODE (PD roles: the KV travels
    through the link given to `attach_link`).
    """

    def __init__(self, config: EngineConfig, kv_role: KVRole = KVRole.LOCAL, tp: TPGroup | None = None,
                 comm=None, digest_every: int = 0):
        self.config = config
        if config.threads:
            # this rank's share of the cores (the CLI's default) or --threads: OpenMP teams
            # must never share a core; 0 keeps torch's process-wide setting
            apply_threads(config.threads)
        # before the model loads: layers may pick their kernels when they are built
        self.kernels = ops.configure(config.device, config.torch_dtype(), config.kernels)
        self.model_dir = resolve_model_path(config.model)
        hf_config = read_config(self.model_dir)
        dtype = config.torch_dtype()
        self.trace = CollectiveTrace()
        # overlap: the model's collectives run on the forward thread, recorded in their own order
        model_trace = CollectiveTrace() if config.overlap else self.trace
        tp = tp or TPGroup()
        tp = TPGroup(tp.rank, tp.size, tp.group, model_trace)
        self.comm = comm or LocalComm(self.trace)
        self.comm.trace = self.trace
        self.rank = tp.rank
        self.model = load_model(self.model_dir, dtype, config.device, tp, config.nvfp4_mode,
                                config.quantization)
        self.vocab_size = int(hf_config["vocab_size"])  # the embedding's rows: the ids a prompt may hold
        if config.threads and multiplies_natively(self.model):
            apply_threads(config.threads, torch_threads=1)  # the cores are the kernels' (threads.py)
        kv_dtype = config.kv_torch_dtype()
        specs = self.model.cache_spec(kv_dtype, INDEX_DTYPES[config.index_cache_dtype])
        if kv_dtype != dtype and any(s.name not in ("k", "v") for layer in specs for s in layer):
            raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype} is for models whose cache is K and V "
                             f"(the Llama family); this model keeps "
                             f"{sorted({s.name for layer in specs for s in layer})}")
        # the pool and the context reconciled: a request at the full context always fits alone
        fit = fit_context(config, KVPool.bytes_per_block(specs, config.block_size),
                          hf_config.get("max_position_embeddings", 4096))
        num_blocks = fit.num_blocks
        self.pool = KVPool(specs, num_blocks, config.block_size, config.device)
        # a decode worker caches too: its rooms take the blocks it kept, and only the rest of a
        # prompt's KV travels; it has no host tier (a room takes device blocks only)
        caching = config.prefix_cache
        host_blocks = config.host_cache_memory // KVPool.bytes_per_block(specs, config.block_size)
        host = HostTier(self.pool, host_blocks) if caching and host_blocks and kv_role != KVRole.DECODE else None
        self.allocator = BlockAllocator(num_blocks, caching=caching, host=host)
        max_len = fit.max_model_len
        # everything besides the tokens that shapes a block's KV starts its names' chain
        salt = salt_of(str(self.model_dir), str(dtype), str(kv_dtype), config.quantization, config.nvfp4_mode,
                       config.index_cache_dtype, config.block_size, tp.size)
        # a PD prefill worker never decodes: no stream waits on its steps, so only an explicit
        # --max-prefill-tokens bounds them (docs/step-budget.md)
        prefill_tokens = config.prefill_budget() if kv_role != KVRole.PREFILL else config.max_prefill_tokens
        self.scheduler = Scheduler(
            SchedulerConfig(config.block_size, config.max_num_seqs, config.max_num_batched_tokens, max_len,
                            salt, overlap=config.overlap, max_prefill_tokens=prefill_tokens,
                            first_token_slack=config.first_token_budget()),
            self.allocator, eos_token_ids(self.model_dir))
        self.runner = ModelRunner(self.model, self.pool, config.device, tp)
        why = (cuda_graphs.unusable(self.model, config.device, tp.size, dtype) if config.cuda_graphs
               else "--no-cuda-graphs")
        if why is None:
            self.runner.graphs = cuda_graphs.DecodeGraphs(self.model, self.pool, config.device, max_len,
                                                          config.max_num_seqs)
            self.runner.prompt_graphs = cuda_graphs.PromptGraphs(self.model, config.device, max_len,
                                                                 config.max_num_batched_tokens)
        elif config.device.startswith("cuda"):
            logger.info("CUDA graphs off: %s; every step runs eagerly", why)
        # constrained decoding: only rank 0 samples, so only its cache ever compiles (lockstep.py)
        self.grammars = self.runner.grammars = grammars_for_model(self.model_dir)
        self.kv_role = KVRole(kv_role)
        traces = Traces(self.trace, model_trace) if config.overlap else self.trace
        self.loop = LockstepLoop(self.scheduler, self.comm, self.runner.run, None, digest_every, traces,
                                 stage_batch=self.runner.stage if config.overlap else None)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._carry: list = []  # inbox items held back by the plan-size budget
        self._resets: list[Future] = []  # prefix cache resets the step being made carries
        # Aborts seen by rank 0's inbox, so that a request whose abort overtook it is refused when
        # it comes. Its own store: the scheduler forgets ids it never admitted, the transfer
        # agents' tombstones are per rank and per room, and an abort must win over a late add
        # of a request that never had a room (colocated workers have no agent at all).
        self._aborted = RecentIds(ttl_s=ABORT_TOMBSTONE_TTL_S)
        # rank 0: how soon new requests follow finished ones (a server's; the offline engine waits for none)
        self.follow_ups = FollowUps(config.follow_up_wait())
        self._prompts: dict[str, list[int]] = {}  # rank 0, with a wait: admitted requests' prompts

    def attach_link(self, link) -> None:
        """Use a transfer link (`KVLink`, or a test's wrapper of one) in the lockstep loop."""
        self.loop.link = link

    def attach_transfer(self, agent, rank: int = 0) -> KVLink:
        """Use a transfer agent over this engine's pool (a target for decode, a source for prefill)."""
        link = KVLink(agent, rank)
        self.attach_link(link)
        return link

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    peer: KVPeer | None = None) -> None:
        """Queue a request. PD roles pass their `peer` (see `KVPeer`)."""
        self.check(prompt_ids, params)
        # a decode worker computes a request that comes without a prefill peer itself
        kv = KVRole.LOCAL if self.kv_role is KVRole.DECODE and peer is None else self.kv_role
        self._inbox.put(NewRequest(request_id, list(prompt_ids), params, time.monotonic(), kv=kv, peer=peer))

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming what is wrong with a request. Bad input must never reach the loop,
        where it would fail every request of the worker (an id past the embedding, say)."""
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if params.resumed_tokens >= len(prompt_ids):
            raise ValueError("resumed_tokens must be below the prompt's length (a prompt token precedes the output)")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            bad = next(t for t in prompt_ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Abort at any moment (waiting, prefilling, decoding); unknown ids are ignored."""
        self._inbox.put((request_id, FinishReason(reason)))

    def peer_dead(self, rooms: list[str], reason: str) -> None:
        """The other worker of these rooms died: every rank fails and fences them (kv_link)."""
        self._inbox.put(PeerDeadRooms(list(rooms), reason))

    def reset_prefix_cache(self) -> Future:
        """Forget the prefix cache in the next step, on every rank (`StepPlan.reset_cache`).
        The future's result, once that step is applied, is how many cached unreferenced device
        blocks were forgotten."""
        done: Future = Future()
        self._inbox.put(done)
        return done

    @property
    def prefix_salt(self) -> BlockHash | None:
        """Where this worker's block-name chains start (None: no prefix cache)."""
        return self.scheduler.config.cache_salt if self.scheduler.allocator.caching else None

    def cached_prefix(self, names: list[BlockHash]) -> tuple[int, int]:
        """How many leading `names` the prefix cache holds now: in the device pool, then, after
        those, in the host tier. Only reads (any thread may ask; the loop may change the answer
        the next moment): the router's guess of where a prompt is cached."""
        allocator = self.scheduler.allocator
        device = len(allocator.lookup(names))
        return device, allocator.host_chain(names[device:])

    def _drain(self) -> Inbox:
        inbox = Inbox()
        # a TP plan travels in a fixed-size buffer: admit about what fits, the rest next step (one
        # request larger than that alone goes as it is: its plan takes a second broadcast, comm.py)
        budget = (self.comm.plan_bytes or 1 << 62) // 2
        items, self._carry = self._carry, []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if isinstance(item, PeerDeadRooms):  # a bounded share of the plan; the rest next step
                each = len(item.reason.encode()) + 64  # a room id and its reason, pickled
                space = min(MAX_PEER_DEAD_PER_STEP - len(inbox.peer_dead), max(0, budget // each))
                inbox.peer_dead += [(rid, item.reason) for rid in item.rooms[:space]]
                budget -= each * min(space, len(item.rooms))
                if item.rooms[space:]:
                    self._carry.append(PeerDeadRooms(item.rooms[space:], item.reason))
            elif isinstance(item, Future):
                inbox.reset_cache = True
                self._resets.append(item)
            elif isinstance(item, NewRequest):
                cost = 8 * len(item.prompt_ids) + 1024
                if item.peer is not None:  # a prefill's peer carries the decode ranks' bootstraps
                    cost += sum(len(b) for b in item.peer.bootstrap) + 8 * len(item.peer.blocks)
                if item.params.structured is not None:  # the spec travels in the plan too
                    cost += len(item.params.structured.value.encode())
                if cost > budget and inbox.new:
                    self._carry.append(item)
                    continue
                budget -= cost
                inbox.new.append(item)
                if item.request_id in self._aborted:  # the abort overtook the request
                    inbox.aborts.append((item.request_id, FinishReason.ABORT))
            else:
                inbox.aborts.append(item)
                self._aborted.add(item[0])
        return inbox

    def step(self, shutdown: bool = False) -> tuple[StepPlan, list[StepOutput]]:
        """One lockstep iteration (see scheduler/lockstep.py). Rank 0 drains the inbox; other
        ranks only follow the plan. Returns the plan and what requests produced."""
        inbox = self._drain() if self.rank == 0 else Inbox()
        inbox.shutdown = shutdown
        if self.rank == 0:
            inbox.follow_up_wait = self._follow_up_wait(inbox)
        forgotten = self.allocator.num_forgotten
        plan, outputs = self.loop.step(inbox)
        if self.rank == 0:
            self._observe_finishes(plan, outputs)
        resets, self._resets = self._resets, []
        for done in resets:  # the plan that carried them is applied
            done.set_result(self.allocator.num_forgotten - forgotten)
        for req in plan.deferred:  # a decode room waits for blocks; try again next step
            self._inbox.put(req)
        return plan, outputs

    def _follow_up_wait(self, inbox: Inbox) -> float:
        """How long this step may wait for a finished request's next turn (scheduler/follow_ups.py),
        once the new prompts here have been seen to follow earlier finishes or not."""
        if not self.follow_ups.window_s:
            return 0.0
        for req in inbox.new:
            if req.kv is KVRole.LOCAL:
                self.follow_ups.arrived(req.prompt_ids, req.arrival)
        return self.follow_ups.wait(time.monotonic())

    def _observe_finishes(self, plan: StepPlan, outputs: list[StepOutput]) -> None:
        """This step's finishes wait for their next turns; admitted prompts may finish later."""
        if not self.follow_ups.window_s:
            return
        for req in plan.admitted:
            self._prompts[req.request_id] = req.prompt_ids
        for out in outputs:
            if out.finish_reason is not None and (prompt := self._prompts.pop(out.request_id, None)):
                if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                    self.follow_ups.finished(prompt, self.loop.emitted_at, waited=plan.follow_up_wait > 0)

    def inbox_empty(self) -> bool:
        return self._inbox.empty()

    def waits(self, plan: StepPlan) -> bool:
        """The next step has nothing to do until something comes from outside (a request, an
        abort, a transfer's outcome, the clock): `plan`, this step's, changed nothing, and no
        token, forward or request is pending. A worker then naps instead of stepping at once."""
        return (plan.idle and not self.loop.sampled and not self.loop.in_flight and not self._carry
                and self._inbox.empty())

    def has_work(self) -> bool:
        return (self.scheduler.has_work() or bool(self.loop.sampled) or self.loop.in_flight
                or bool(self._carry) or not self._inbox.empty())

    @torch.inference_mode()
    def run_until_done(self) -> list[StepOutput]:
        """Step until every request has finished; returns all outputs in order."""
        outputs: list[StepOutput] = []
        while self.has_work():
            outputs += self.step()[1]
        return outputs

    def close(self) -> None:
        """Wait for a running forward (overlap) and stop the forward thread."""
        self.loop.close()
