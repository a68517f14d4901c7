"""Multi-head latent attention (DeepSeek-V2/V3, GLM-5), over a paged cache of compressed latents.

Per token the cache holds only `kv_lora_rank + qk_rope_head_dim` numbers per layer (`latent`):
the normalized KV latent c and the shared rotary key k_rot. The per-head keys and values are
`kv_b_proj(c)` split into k_nope and v. Two equal ways to attend:

* expanded (prefill): run kv_b_proj over the whole context and attend with ordinary heads —
  cheapest when there are about as many queries as context tokens;
* absorbed (decode): fold kv_b_proj into the query and the output instead,
  q_nope·k_nope = (q_nope W_UK)·c and Σ p·v = (Σ p·c) W_UVᵀ, so attention runs directly on the
  latents and costs per query O(context · (kv_lora_rank + rope)) instead of a projection of
  the whole context.

Heads are split across TP ranks (q_b_proj/kv_b_proj column-parallel, o_proj row-parallel); the
latent projection is replicated, so every rank caches the same latents.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.distributed import TPGroup
from pdserve.layers.attention import SeqSpan
from pdserve.layers.dsa import Indexer
from pdserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pdserve.layers.norm import RMSNorm
from pdserve.layers.quant import QuantConfig, linear_method
from pdserve.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class MLADims:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None      # None: one q_proj (DeepSeek-V3 without query compression)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool


class MLAttention(nn.Module):
    """One layer's MLA; with an `indexer` (DSA) attention is restricted to its top-k tokens."""

    def __init__(self, d: MLADims, layer_idx: int, rotary: RotaryEmbedding, scale: float,
                 tp: TPGroup = TPGroup(), quant: QuantConfig | None = None,
                 indexer: Indexer | None = None):
        super().__init__()
        if d.num_heads % tp.size:
            raise ValueError(f"{d.num_heads} attention heads do not split over TP size {tp.size}")
        p = f"model.layers.{layer_idx}.self_attn"
        self.d, self.layer_idx, self.scale = d, layer_idx, scale
        self.heads = d.num_heads // tp.size
        qk = d.qk_nope_head_dim + d.qk_rope_head_dim
        if d.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(d.hidden_size, d.num_heads * qk, tp=tp,
                                               method=linear_method(quant, [f"{p}.q_proj"]))
        else:
            self.q_a_proj = ReplicatedLinear(d.hidden_size, d.q_lora_rank, bias=d.attention_bias,
                                             method=linear_method(quant, [f"{p}.q_a_proj"]))
            self.q_a_layernorm = RMSNorm(d.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(d.q_lora_rank, d.num_heads * qk, tp=tp,
                                                 method=linear_method(quant, [f"{p}.q_b_proj"]))
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            d.hidden_size, d.kv_lora_rank + d.qk_rope_head_dim, bias=d.attention_bias,
            method=linear_method(quant, [f"{p}.kv_a_proj_with_mqa"]))
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(d.kv_lora_rank, d.num_heads * (d.qk_nope_head_dim + d.v_head_dim),
                                              tp=tp, method=linear_method(quant, [f"{p}.kv_b_proj"]))
        self.o_proj = RowParallelLinear(d.num_heads * d.v_head_dim, d.hidden_size, bias=d.attention_bias,
                                        tp=tp, method=linear_method(quant, [f"{p}.o_proj"]))
        self.rotary = rotary
        self.indexer = indexer
        self._w_kv_b: torch.Tensor | None = None  # [heads, nope + v, kv_lora], for the absorbed form

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: dict[str, torch.Tensor],
                slots: torch.Tensor, seqs: list[SeqSpan], shared_masks: list[torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Attend for a step's tokens `x` `[T, hidden]`; returns the output and the DSA masks
        (this layer's, or `shared_masks` reused from an earlier layer; None without DSA)."""
        d, t = self.d, x.shape[0]
        if d.q_lora_rank is None:
            q_latent, q = None, self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        q = q.view(t, self.heads, d.qk_nope_head_dim + d.qk_rope_head_dim)
        q_nope, q_rot = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        q_rot, k_rot = self.rotary(positions, q_rot, k_rot.view(t, 1, d.qk_rope_head_dim))
        latents = cache["latent"].view(-1, d.kv_lora_rank + d.qk_rope_head_dim)
        latents[slots] = torch.cat((self.kv_a_layernorm(c), k_rot.view(t, -1)), dim=-1).to(latents.dtype)

        masks = shared_masks
        if self.indexer is not None:
            masks = self.indexer(x, q_latent, positions, cache, slots, seqs)
        out = x.new_empty(t, self.heads, d.v_head_dim)
        decode = []
        for i, s in enumerate(seqs):
            mask = s.causal if masks is None else masks[i]
            if s.queries.stop - s.queries.start == 1:
                decode.append((s, mask))
            else:
                out[s.queries] = self._expanded(q_nope[s.queries], q_rot[s.queries], latents[s.context_slots], mask)
        if decode:
            rows = torch.tensor([s.queries.start for s, _ in decode], device=x.device)
            out[rows] = self._absorbed(q_nope[rows], q_rot[rows], [(latents[s.context_slots], m) for s, m in decode])
        return self.o_proj(out.flatten(1)), masks

    def _probs(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Softmax over the context of `scores` `[heads, queries, context]` where `mask` allows."""
        scores = scores.float().masked_fill(~mask[None], float("-inf")) * self.scale
        return torch.softmax(scores, dim=-1)

    def _expanded(self, q_nope: torch.Tensor, q_rot: torch.Tensor, ctx: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
        """One sequence's queries `[n, heads, ...]` over its context latents `[c, latent]`."""
        d = self.d
        c, k_rot = ctx.split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c.to(q_nope.dtype)).view(-1, self.heads, d.qk_nope_head_dim + d.v_head_dim)
        k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
        scores = (torch.einsum("nhd,chd->hnc", q_nope, k_nope)
                  + torch.einsum("nhr,cr->hnc", q_rot, k_rot.to(q_rot.dtype)))
        probs = self._probs(scores, mask).to(v.dtype)
        return torch.einsum("hnc,chv->nhv", probs, v)

    def _absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor,
                  contexts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One query per sequence (`[seqs, heads, ...]`), each over its own cached latents.

        The absorption matmuls run once for all sequences; per sequence, the query in latent
        space `[heads, kv_lora + rope]` meets the cached rows `[c, kv_lora + rope]` as they are."""
        d = self.d
        w_uk, w_uv = self.kv_b_weight().split([d.qk_nope_head_dim, d.v_head_dim], dim=1)
        q = torch.cat((torch.einsum("nhd,hdl->nhl", q_nope, w_uk), q_rot), dim=-1)
        o_latent = q.new_empty(q.shape[0], self.heads, d.kv_lora_rank)
        for j, (ctx, mask) in enumerate(contexts):
            ctx = ctx.to(q.dtype)
            probs = self._probs((q[j] @ ctx.T)[:, None, :], mask)[:, 0].to(q.dtype)  # [heads, c]
            o_latent[j] = probs @ ctx[:, :d.kv_lora_rank]
        return torch.einsum("nhl,hvl->nhv", o_latent, w_uv)

    def kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj as a dense `[heads, nope + v, kv_lora]` matrix, whatever its LinearMethod:
        the projection of the identity (computed once, after loading)."""
        if self._w_kv_b is None:
            d = self.d
            eye = torch.eye(d.kv_lora_rank, dtype=self.kv_a_layernorm.weight.dtype,
                            device=self.kv_a_layernorm.weight.device)
            w = self.kv_b_proj(eye).view(d.kv_lora_rank, self.heads, d.qk_nope_head_dim + d.v_head_dim)
            self._w_kv_b = w.permute(1, 2, 0).contiguous()
        return self._w_kv_b
