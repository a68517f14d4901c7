"""The single-process engine: observe → plan → apply, one rank.

`step()` is the whole loop body: drain the inbox, let the scheduler plan, apply the plan, run
the batch. Tokens sampled in a step travel in the next step's plan, so that later, with tensor
parallelism, rank 0's sampling reaches every rank through the same single broadcast.
"""
from __future__ import annotations

import logging
import queue
import time

import torch

from pdserve.kvcache import BlockAllocator, KVPool
from pdserve.models import eos_token_ids, load_model, read_config
from pdserve.scheduler import Inbox, NewRequest, Scheduler, SchedulerConfig, StepOutput
from pdserve.scheduler.plan import SampledToken
from pdserve.weights import resolve_model_path

from .config import EngineConfig
from .model_runner import ModelRunner
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over one model, on token ids; thread-safe `add_request` / `abort`."""

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.threads:
            # on a small CPU shared by several workers, one thread each beats contended OpenMP teams
            torch.set_num_threads(config.threads)
        self.model_dir = resolve_model_path(config.model)
        hf_config = read_config(self.model_dir)
        dtype = config.torch_dtype()
        self.model = load_model(self.model_dir, dtype, config.device)
        specs = self.model.cache_spec(dtype)
        num_blocks = KVPool.blocks_for_budget(config.kv_cache_memory, self.model.num_layers, specs,
                                              config.block_size)
        self.pool = KVPool(self.model.num_layers, specs, num_blocks, config.block_size, config.device)
        self.allocator = BlockAllocator(num_blocks)
        max_len = config.max_model_len or hf_config.get("max_position_embeddings", 4096)
        self.scheduler = Scheduler(
            SchedulerConfig(config.block_size, config.max_num_seqs, config.max_num_batched_tokens, max_len),
            self.allocator, eos_token_ids(self.model_dir))
        self.runner = ModelRunner(self.model, self.pool, config.device)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sampled: list[SampledToken] = []
        self._step = 0

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        self._inbox.put(NewRequest(request_id, list(prompt_ids), params, time.monotonic()))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Abort at any moment (waiting, prefilling, decoding); unknown ids are ignored."""
        self._inbox.put((request_id, reason))

    def _drain(self) -> Inbox:
        inbox = Inbox()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return inbox
            if isinstance(item, NewRequest):
                inbox.new.append(item)
            else:
                inbox.aborts.append(item)

    def step(self) -> list[StepOutput]:
        """One iteration: observe → plan → apply → run. Returns what requests produced."""
        plan = self.scheduler.plan(self._step, self._drain(), self._sampled)
        outputs, batch = self.scheduler.apply(plan)
        self._sampled = self.runner.run(batch)
        self._step += 1
        return outputs

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._sampled) or not self._inbox.empty()

    @torch.inference_mode()
    def run_until_done(self) -> list[StepOutput]:
        """Step until every request has finished; returns all outputs in order."""
        outputs: list[StepOutput] = []
        while self.has_work():
            outputs += self.step()
        return outputs
