"""Steps as CUDA graphs: a decode step's whole forward per batch size, a prompt step's forward in
pieces per bucket of token counts, captured once and replayed.

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

Prompt and mixed steps (`PromptGraphs`) are captured piecewise, as vLLM does: the attention of
such a step reads every sequence's context through its own offsets, so it stays eager, and the
graphs hold everything between two attention calls. A step of t tokens replays the graphs of the
smallest bucket of token counts that holds it (16, 32, ... up to the step's token budget), its
rows past t padding that no attention stores or reads. A prompt step of the default model is
then 31 replays and 30 eager attention calls (a few launches each) instead of about 1,000
launches: 12 ms instead of 35 on an H200 (docs/gpu.md).
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch

import pdserve_kernels as ops
from pdserve.kvcache import KVPool
from pdserve.layers.attention import Attention, AttentionMetadata
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


class StepGraphs:
    """What decode and prompt graphs share: the model, a stream of their own for warm-ups and
    captures, the captured graphs by key, and the reason they were turned off (None: on)."""

    kind = ""  # "decode" / "prompt", for the log

    def __init__(self, model: torch.nn.Module, device: str, max_model_len: int):
        self.model, self.device = model, torch.device(device)
        self.graphs: dict = {}
        self.disabled: str | None = None
        self.stream = torch.cuda.Stream(self.device)
        for module in model.modules():  # no step reads its largest position back to the host
            if isinstance(module, RotaryEmbedding):
                module.cover(max_model_len, self.device)

    def _capture(self, key: int):
        """Capture `key`'s graph (a batch size, a bucket): each kind defines it."""
        raise NotImplementedError

    def _warm_up_and_capture(self, key: int, what: str, ids: torch.Tensor, positions: torch.Tensor,
                             meta: AttentionMetadata) -> torch.Tensor:
        """Run this step eagerly on the graphs' stream (the capture's warm-up, with the step's
        real inputs), then capture `key` (`what`, for the log) there."""
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            hidden = self.model(ids, positions, meta)
        compute.wait_stream(self.stream)
        hidden.record_stream(compute)
        try:
            self.graphs[key] = self._capture(key)
            logger.info("captured the %s forward for %s (%d graphs)", self.kind, what, len(self.graphs))
        except Exception as err:  # noqa: BLE001 - any failure leaves the eager forward, which is always right
            self.disabled = f"capturing {what} failed: {err!r}"[:300]
            logger.warning("%s graphs off for this engine: %s; %s steps run eagerly", self.kind, self.disabled,
                           self.kind)
        return hidden


class DecodeGraphs(StepGraphs):
    """The captured decode forwards of one engine, by batch size (up to `max_batch`)."""

    kind = "decode"

    def __init__(self, model: torch.nn.Module, pool: KVPool, device: str, max_model_len: int, max_batch: int):
        super().__init__(model, device, max_model_len)
        self.pool, self.max_batch, self.max_model_len = pool, max_batch, max_model_len
        self.width = math.ceil(max_model_len / pool.block_size)
        self.graphs: dict[int, DecodeGraph] = {}

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The hidden states of a decode step (one new token per sequence), through its batch
        size's graph; None when this step is to run eagerly."""
        n = len(meta.context_lens)
        if self.disabled is not None or n > self.max_batch or meta.query_start_loc[-1] != n:
            return None
        graph = self.graphs.get(n)
        if graph is None:
            return self._warm_up_and_capture(n, f"batch {n}", ids, positions, meta)
        graph.ids.copy_(ids)
        graph.positions.copy_(positions)
        graph.slots.copy_(meta.slot_mapping)
        graph.tables[:, :meta.block_tables.shape[1]].copy_(meta.block_tables)  # columns past it: never read
        graph.lens.copy_(torch.tensor(meta.context_lens, dtype=torch.int32), non_blocking=True)
        graph.graph.replay()
        graph.replays += 1
        return graph.hidden

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


def prompt_buckets(max_tokens: int) -> list[int]:
    """The token counts prompt graphs are captured for: powers of two from 16, then the step
    budget itself (a step never holds more)."""
    sizes, n = [], 16
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return sizes + [max_tokens]


@dataclass
class AttentionCall:
    """One attention layer of a prompt graph: the graph segment that ends at it, the q, k and v
    that segment leaves (`[bucket, heads, head_dim]`, in the graph's memory), and `out`, the
    attention's result that the next segment reads."""

    before: torch.cuda.CUDAGraph
    layer: Attention
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor


@dataclass
class PromptGraph:
    """One bucket's captured segments and the buffers they read and write."""

    ids: torch.Tensor        # int64 [bucket]
    positions: torch.Tensor  # int64 [bucket]
    calls: list[AttentionCall]
    after: torch.cuda.CUDAGraph  # from the last attention to the final norm
    hidden: torch.Tensor     # [bucket, hidden]
    replays: int = 0


class PromptGraphs(StepGraphs):
    """The piecewise-captured forwards of one engine's steps that are not decode steps, by
    bucket of token counts (up to `max_tokens`)."""

    kind = "prompt"

    def __init__(self, model: torch.nn.Module, device: str, max_model_len: int, max_tokens: int):
        super().__init__(model, device, max_model_len)
        self.buckets = prompt_buckets(max_tokens)
        self.graphs: dict[int, PromptGraph] = {}
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The hidden states of the step's `t` tokens through its bucket's graphs; None when this
        step is to run eagerly."""
        t = ids.shape[0]
        if self.disabled is not None or t > self.buckets[-1]:
            return None
        size = next(b for b in self.buckets if b >= t)
        graph = self.graphs.get(size)
        if graph is None:
            return self._warm_up_and_capture(size, f"{size} tokens", ids, positions, meta)
        graph.ids[:t].copy_(ids)
        graph.positions[:t].copy_(positions)
        for call in graph.calls:
            call.before.replay()
            call.out[:t].copy_(call.layer.attend(call.q[:t], call.k[:t], call.v[:t], meta))
        graph.after.replay()
        graph.replays += 1
        return graph.hidden[:t]

    def _capture(self, size: int) -> PromptGraph:
        """One forward of `size` tokens, captured as segments that end at each attention layer
        (`Attention.split`); nothing runs, so no KV slot is written."""
        dev = self.device
        ids = torch.zeros(size, dtype=torch.long, device=dev)
        positions = torch.zeros(size, dtype=torch.long, device=dev)
        no_slots = torch.zeros(0, dtype=torch.long, device=dev)
        meta = AttentionMetadata([0, size], [size], no_slots, no_slots, [])  # no split layer reads it
        pool = torch.cuda.graph_pool_handle()  # one pool: a segment reads what the one before left
        calls: list[AttentionCall] = []
        segment, capturing = torch.cuda.CUDAGraph(), False

        def split(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            nonlocal segment, capturing
            segment.capture_end()
            capturing = False
            out = torch.empty(size, q.shape[1] * q.shape[2], dtype=q.dtype, device=dev)
            calls.append(AttentionCall(segment, layer, q, k, v, out))
            segment = torch.cuda.CUDAGraph()
            segment.capture_begin(pool=pool, capture_error_mode="thread_local")
            capturing = True
            return out

        torch.cuda.synchronize(dev)
        for layer in self.layers:
            layer.split = split
        try:
            with torch.cuda.stream(self.stream):
                # thread_local: an overlapped loop's thread may use CUDA while this one captures
                segment.capture_begin(pool=pool, capture_error_mode="thread_local")
                capturing = True
                hidden = self.model(ids, positions, meta)
                segment.capture_end()
                capturing = False
        finally:
            for layer in self.layers:
                layer.split = None
            if capturing:  # a failed capture still has to end before CUDA can be used again
                with contextlib.suppress(Exception):
                    segment.capture_end()
        if len(calls) != len(self.layers):
            raise RuntimeError(f"{len(calls)} attention calls captured, the model has {len(self.layers)}")
        return PromptGraph(ids, positions, calls, segment, hidden)
