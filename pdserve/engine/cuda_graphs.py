"""Decode steps as CUDA graphs: one captured forward per batch size, replayed.

On a GPU the op-by-op forward is bound by the host: a decode step of the default model (30
layers) launches about 1,000 kernels, 25–45 ms of host time around a few ms of kernels
(docs/gpu.md).
A graph records those launches once and replays them with one call.

A graph reads fixed addresses, so what changes between steps lives in buffers the graph owns
(input ids, positions, cache slots, int32 block tables as wide as the context, int32 lengths);
a replay copies the step's values into them first. While capturing, the attention's per-step
inputs are pointed at those buffers (`attention_cuda.use_decode_inputs`) and its split count is
the one for the longest context, so one graph serves every length; the rotary table covers the
whole context beforehand (`RotaryEmbedding.cover`), so no step reads a position back to the host.

A batch size's first decode step runs eagerly on the graphs' stream (the capture's warm-up, with
the step's real inputs), then its graph is captured: capturing launches nothing, so no KV slot is
written twice. A capture that fails turns graphs off for the engine, with one warning, and every
step runs eagerly from then on.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

import pdserve_kernels as ops
from pdserve.kvcache import KVPool
from pdserve.layers.attention import AttentionMetadata
from pdserve.layers.rotary import RotaryEmbedding
from pdserve_kernels import attention_cuda

logger = logging.getLogger(__name__)


@dataclass
class DecodeGraph:
    """One batch size's captured forward and the buffers it reads and writes."""

    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor        # int64 [n]
    positions: torch.Tensor  # int64 [n]
    slots: torch.Tensor      # int64 [n]
    tables: torch.Tensor     # int32 [n, context blocks]
    lens: torch.Tensor       # int32 [n]
    hidden: torch.Tensor     # the forward's output, [n, hidden]
    replays: int = 0


def unusable(model: torch.nn.Module, device: str, tp_size: int, dtype: torch.dtype) -> str | None:
    """Why this engine's decode steps cannot be captured (None: they can)."""
    from pdserve.models.llama import LlamaForCausalLM

    if not device.startswith("cuda"):
        return "not a CUDA device"
    if tp_size > 1:
        return "tensor parallelism (the collectives run outside the GPU's streams)"
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not in the Llama family"
    if not ops.is_native(ops.paged_attention):
        return "the attention runs the torch reference (--kernels torch)"
    probe = torch.empty(1, 1, model.config.head_dim, dtype=dtype, device=device)
    if not attention_cuda.supports(probe):
        return f"head_dim {model.config.head_dim} / {dtype} is not one the CUDA decode kernel takes"
    return None


class DecodeGraphs:
    """The captured decode forwards of one engine, by batch size (up to `max_batch`)."""

    def __init__(self, model: torch.nn.Module, pool: KVPool, device: str, max_model_len: int, max_batch: int):
        self.model, self.pool, self.max_batch = model, pool, max_batch
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.width = math.ceil(max_model_len / pool.block_size)
        self.graphs: dict[int, DecodeGraph] = {}
        self.disabled: str | None = None
        self.stream = torch.cuda.Stream(self.device)
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.cover(max_model_len, self.device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The hidden states of a decode step (one new token per sequence), through its batch
        size's graph; None when this step is to run eagerly."""
        n = len(meta.context_lens)
        if self.disabled is not None or n > self.max_batch or meta.query_start_loc[-1] != n:
            return None
        graph = self.graphs.get(n)
        if graph is None:
            return self._warm_up_and_capture(n, ids, positions, meta)
        graph.ids.copy_(ids)
        graph.positions.copy_(positions)
        graph.slots.copy_(meta.slot_mapping)
        graph.tables[:, :meta.block_tables.shape[1]].copy_(meta.block_tables)  # columns past it: never read
        graph.lens.copy_(torch.tensor(meta.context_lens, dtype=torch.int32), non_blocking=True)
        graph.graph.replay()
        graph.replays += 1
        return graph.hidden

    def _warm_up_and_capture(self, n: int, ids: torch.Tensor, positions: torch.Tensor,
                             meta: AttentionMetadata) -> torch.Tensor:
        """Run this step eagerly on the graphs' stream, then capture batch size n there."""
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            hidden = self.model(ids, positions, meta)
        compute.wait_stream(self.stream)
        hidden.record_stream(compute)
        try:
            self.graphs[n] = self._capture(n)
            logger.info("captured the decode forward for batch %d (%d graphs)", n, len(self.graphs))
        except Exception as err:  # noqa: BLE001 - any failure leaves the eager forward, which is always right
            self.disabled = f"capturing batch {n} failed: {err!r}"[:300]
            logger.warning("CUDA graphs off for this engine: %s; decode steps run eagerly", self.disabled)
        return hidden

    def _capture(self, n: int) -> DecodeGraph:
        dev = self.device
        g = DecodeGraph(torch.cuda.CUDAGraph(), torch.zeros(n, dtype=torch.long, device=dev),
                        torch.zeros(n, dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.long, device=dev),
                        torch.zeros(n, self.width, dtype=torch.int32, device=dev),
                        torch.ones(n, dtype=torch.int32, device=dev), torch.empty(0, device=dev))
        longest = [self.max_model_len] * n  # the split count for the longest context
        meta = AttentionMetadata(list(range(n + 1)), longest, g.tables, g.slots, self.pool.layers)
        attention_cuda.use_decode_inputs(g.tables, longest, g.tables, g.lens)
        # thread_local: an overlapped loop's thread may use CUDA while this one captures
        with torch.cuda.graph(g.graph, stream=self.stream, capture_error_mode="thread_local"):
            g.hidden = self.model(g.ids, g.positions, meta)
        return g
