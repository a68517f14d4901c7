"""DeepSeek Sparse Attention's lightning indexer: which past tokens each query attends to.

For query t and past token s the indexer scores  Σ_h w[t,h] · relu(q[t,h] · k[s]) / sqrt(D·H)
with its own small projections (per-head queries from the query latent, one key per token), and
attention keeps the `index_topk` best-scoring tokens at or before t. The keys are cached per
token beside the MLA latent (`index_k`): in bf16 by default — keeping them in fp8 loses recall
on long contexts — or, as DeepSeek's reference kernels do, in fp8 e4m3 with one fp32 scale per
token (`index_k_scale`), Hadamard-rotated, scored against fp8 queries.

Index heads are split across TP ranks; each rank sums its heads' scores and one all_reduce per
layer (all sequences of the step together) gives every rank the same scores, hence the same
top-k choice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed import TPGroup
from pdserve.kvcache import CacheTensorSpec
from pdserve.layers.attention import SeqSpan
from pdserve.layers.linear import ColumnParallelLinear, ReplicatedLinear
from pdserve.layers.norm import LayerNorm
from pdserve.layers.quant import QuantConfig, linear_method
from pdserve.layers.rotary import RotaryEmbedding

FP8_MAX = 448.0  # largest float8_e4m3fn value
INDEX_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": torch.float8_e4m3fn}


def index_cache_spec(head_dim: int, dtype: torch.dtype) -> list[CacheTensorSpec]:
    """The indexer's per-token cache tensors for keys stored as `dtype`."""
    specs = [CacheTensorSpec("index_k", (head_dim,), dtype)]
    if dtype == torch.float8_e4m3fn:
        specs.append(CacheTensorSpec("index_k_scale", (1,), torch.float32))
    return specs


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and one fp32 scale per row of the last dim (x ≈ values · scale)."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal n×n Hadamard matrix (n a power of two), Sylvester's construction."""
    if n & (n - 1):
        raise ValueError(f"fp8 index keys need a power-of-two index_head_dim, not {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / n ** 0.5


def store_index_keys(cache: dict[str, torch.Tensor], k: torch.Tensor, slots: torch.Tensor) -> None:
    """Write keys `[T, D]` to their slots in the cache's dtype (fp8: values and scales)."""
    keys = cache["index_k"].view(-1, k.shape[-1])
    if keys.dtype == torch.float8_e4m3fn:
        keys[slots], cache["index_k_scale"].view(-1, 1)[slots] = fp8_quantize(k)
    else:
        keys[slots] = k.to(keys.dtype)


def load_index_keys(cache: dict[str, torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The keys at `slots`, as fp32 `[N, D]`."""
    keys = cache["index_k"].view(-1, cache["index_k"].shape[-1])[slots].float()
    if cache["index_k"].dtype == torch.float8_e4m3fn:
        keys = keys * cache["index_k_scale"].view(-1, 1)[slots]
    return keys


class Indexer(nn.Module):
    """Scores past tokens for every query token and returns, per sequence, the attend mask."""

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int,
                 topk: int, rotary: RotaryEmbedding, prefix: str, tp: TPGroup = TPGroup(),
                 quant: QuantConfig | None = None):
        super().__init__()
        if n_heads % tp.size:
            raise ValueError(f"{n_heads} indexer heads do not split over TP size {tp.size}")
        self.tp = tp
        self.n_heads, self.local_heads = n_heads, n_heads // tp.size
        self.head_dim, self.rope_dim, self.topk = head_dim, rope_dim, topk
        self.wq_b = ColumnParallelLinear(q_lora_rank, n_heads * head_dim, tp=tp,
                                         method=linear_method(quant, [f"{prefix}.wq_b"]))
        self.wk = ReplicatedLinear(hidden_size, head_dim, method=linear_method(quant, [f"{prefix}.wk"]))
        self.k_norm = LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = ColumnParallelLinear(hidden_size, n_heads, tp=tp,
                                                 method=linear_method(quant, [f"{prefix}.weights_proj"]))
        self.rotary = rotary
        self._h: torch.Tensor | None = None

    def _hadamard(self) -> torch.Tensor:
        if self._h is None:
            self._h = hadamard(self.head_dim)
        return self._h

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor,
                cache: dict[str, torch.Tensor], slots: torch.Tensor, seqs: list[SeqSpan]
                ) -> list[torch.Tensor]:
        """Store this step's keys; return per sequence a bool mask `[n_queries, context]` of the
        tokens each query attends to (already causal)."""
        t = x.shape[0]
        q = self.wq_b(q_latent).view(t, self.local_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).view(t, 1, self.head_dim)
        r = self.rope_dim
        q_rot, k_rot = self.rotary(positions, q[..., :r], k[..., :r])
        q = torch.cat((q_rot, q[..., r:]), dim=-1).float()
        k = torch.cat((k_rot, k[..., r:]), dim=-1).view(t, self.head_dim)
        if cache["index_k"].dtype == torch.float8_e4m3fn:
            # as DeepSeek's fp8 indexer: rotate q and k by a Hadamard matrix (dot products are
            # unchanged, outliers spread over all dims) and score fp8 queries against fp8 keys
            h = self._hadamard()
            q_fp8, q_scale = fp8_quantize(q @ h)
            q, k = q_fp8.float() * q_scale, k.float() @ h
        store_index_keys(cache, k, slots)
        weights = self.weights_proj(x).float() * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        partial = []
        for s in seqs:
            keys = load_index_keys(cache, s.context_slots)               # [ctx, D]
            per_head = F.relu(torch.einsum("nhd,cd->nhc", q[s.queries], keys))
            partial.append(torch.einsum("nh,nhc->nc", weights[s.queries], per_head).flatten())
        scores = torch.cat(partial)
        if self.tp.size > 1:
            scores = self.tp.all_reduce(scores)
        masks, offset = [], 0
        for s in seqs:
            n, ctx = s.queries.stop - s.queries.start, s.context_len
            row = scores[offset:offset + n * ctx].view(n, ctx).masked_fill(~s.causal, float("-inf"))
            offset += n * ctx
            chosen = torch.zeros(n, ctx, dtype=torch.bool)
            chosen.scatter_(1, row.topk(min(self.topk, ctx), dim=-1).indices, True)
            masks.append(chosen & s.causal)
        return masks

