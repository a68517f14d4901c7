"""The DeepSeek-V3 family: DeepSeek-V3/R1, DeepSeek-V3.2 (DSA) and GLM-5 (`GlmMoeDsaForCausalLM`).

Multi-head latent attention (pdserve.layers.mla), DeepSeek's MoE (pdserve.layers.moe) after
`first_k_dense_replace` dense layers, and for V3.2/GLM-5 the DSA indexer (pdserve.layers.dsa):
V3.2 runs it in every layer with half-split RoPE; GLM-5 uses interleaved RoPE and may let
"shared" layers reuse the top-k of the last "full" one (`indexer_types`).
"""
from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.distributed import TPGroup
from pdserve.kvcache import CacheTensorSpec
from pdserve.layers.attention import AttentionMetadata, sequence_spans
from pdserve.layers.dsa import Indexer, index_cache_spec
from pdserve.layers.embedding import Embedding, LMHead
from pdserve.layers.mla import MLADims, MLAttention
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.moe import STACKED, MoE
from pdserve.layers.norm import RMSNorm
from pdserve.layers.quant import QuantConfig
from pdserve.layers.rotary import RotaryEmbedding, yarn_mscale

from pdserve.weights.loading import load_tensors, require_loaded, stacked_target

logger = logging.getLogger(__name__)

DSA_ARCHITECTURES = {"DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"}


@dataclass(frozen=True)
class DeepseekConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    mla: MLADims
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    rope_interleave: bool
    tie_word_embeddings: bool
    mlp_layer_types: tuple[str, ...]          # "dense" | "sparse" per layer
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_shared_experts: int
    indexer_types: tuple[str, ...] | None     # "full" | "shared" per layer; None without DSA
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_rope_interleave: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "DeepseekConfig":
        arch = (cfg.get("architectures") or ["DeepseekV3ForCausalLM"])[0]
        n = cfg["num_hidden_layers"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        dense = min(cfg.get("first_k_dense_replace", 0), n)
        mlp_types = cfg.get("mlp_layer_types") or ["dense"] * dense + ["sparse"] * (n - dense)
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            num_layers=n,
            mla=MLADims(cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("q_lora_rank"),
                        cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                        cfg["v_head_dim"], cfg.get("attention_bias", False)),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=None if kind == "default" else rope,
            # V3 checkpoints may opt out; V3.2 and GLM-5 always interleave the MLA rope dims
            rope_interleave=cfg.get("rope_interleave", True) if arch not in DSA_ARCHITECTURES else True,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            mlp_layer_types=tuple(mlp_types),
            n_routed_experts=cfg.get("n_routed_experts") or cfg.get("num_experts") or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            norm_topk_prob=cfg.get("norm_topk_prob", True),
            routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            indexer_types=_indexer_types(arch, cfg),
            index_n_heads=cfg.get("index_n_heads", 0),
            index_head_dim=cfg.get("index_head_dim", 0),
            index_topk=cfg.get("index_topk", 0),
            indexer_rope_interleave=arch == "GlmMoeDsaForCausalLM",
        )

    def softmax_scale(self) -> float:
        scale = (self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim) ** -0.5
        if self.rope_scaling and self.rope_scaling.get("mscale_all_dim"):
            scale *= yarn_mscale(self.rope_scaling["factor"], self.rope_scaling["mscale_all_dim"]) ** 2
        return scale


def _indexer_types(arch: str, cfg: dict) -> tuple[str, ...] | None:
    """Per-layer DSA mode, as GLM-5's config derives it (explicit list, pattern, or freq/offset)."""
    n = cfg["num_hidden_layers"]
    if arch == "DeepseekV32ForCausalLM":
        return ("full",) * n
    if arch != "GlmMoeDsaForCausalLM":
        return None
    if cfg.get("indexer_types"):
        types = tuple(cfg["indexer_types"])
    elif cfg.get("index_topk_pattern") is not None:
        pattern = cfg["index_topk_pattern"]
        types = tuple({"F": "full", "S": "shared"}[c] for c in pattern) if isinstance(pattern, str) else tuple(pattern)
    else:
        freq, offset = max(cfg.get("index_topk_freq", 1), 1), cfg.get("index_skip_topk_offset", 2)
        types = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n))
    if types[0] != "full":
        raise ValueError("the first DSA layer must run its indexer (indexer_types[0] == 'full')")
    return types


def cache_spec(c: DeepseekConfig, dtype: torch.dtype, index_dtype: torch.dtype = torch.bfloat16
               ) -> list[list[CacheTensorSpec]]:
    """Per layer: the MLA latent, plus the DSA index key (in `index_dtype`) where the layer runs
    its indexer (a "shared" layer reuses another's top-k and keeps no keys)."""
    latent = CacheTensorSpec("latent", (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim,), dtype)
    types = c.indexer_types or ("none",) * c.num_layers
    return [[latent] + (index_cache_spec(c.index_head_dim, index_dtype) if t == "full" else [])
            for t in types]


def rotaries(c: DeepseekConfig) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    """The attention's and the indexer's RoPE, one of each shared by every layer (so a step
    reads cos/sin once, not once per layer)."""
    d = c.mla.qk_rope_head_dim
    return (RotaryEmbedding(d, c.rope_theta, c.rope_scaling, c.rope_interleave),
            RotaryEmbedding(d, c.rope_theta, c.rope_scaling, c.indexer_rope_interleave))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, c: DeepseekConfig, layer_idx: int, tp: TPGroup, quant: QuantConfig | None,
                 ropes: tuple[RotaryEmbedding, RotaryEmbedding] | None = None):
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        m = c.mla
        rotary, index_rotary = ropes or rotaries(c)
        indexer = None
        if c.indexer_types is not None and c.indexer_types[layer_idx] == "full":
            indexer = Indexer(m.hidden_size, m.q_lora_rank, c.index_n_heads, c.index_head_dim,
                              m.qk_rope_head_dim, c.index_topk, index_rotary,
                              f"{prefix}.self_attn.indexer", tp, quant)
        self.self_attn = MLAttention(m, layer_idx, rotary, c.softmax_scale(), tp, quant, indexer)
        if c.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = MoE(c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok,
                           c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor,
                           c.n_shared_experts, f"{prefix}.mlp", tp, quant)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, f"{prefix}.mlp", tp, quant)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """Entry point for the three architectures; the interface of pdserve.models.llama."""

    def __init__(self, hf_config: dict, tp: TPGroup = TPGroup(), quant: QuantConfig | None = None):
        super().__init__()
        c = self.config = DeepseekConfig.from_hf(hf_config)
        self.tp, self.quant = tp, quant
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        ropes = rotaries(c)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(c, i, tp, quant, ropes) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = LMHead(c.vocab_size, c.hidden_size, tp,
                              tied_to=self.embed_tokens if c.tie_word_embeddings else None)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def cache_spec(self, dtype: torch.dtype, index_dtype: torch.dtype = torch.bfloat16
                   ) -> list[list[CacheTensorSpec]]:
        return cache_spec(self.config, dtype, index_dtype)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        block_size = meta.kv_caches[0]["latent"].shape[1]
        seqs = sequence_spans(meta, positions, block_size)
        x, residual, masks = self.embed_tokens(ids), None, None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual, x = x, layer.input_layernorm(x)
            else:
                x, residual = layer.input_layernorm(x, residual)
            x, masks = layer.self_attn(x, positions, meta.kv_caches[i], meta.slot_mapping, seqs, masks)
            x, residual = layer.post_attention_layernorm(x, residual)
            x = layer.mlp(x)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def checkpoint_target(self, name: str) -> tuple[str, str, object]:
        """(module, parameter, shard id) that checkpoint tensor `name` loads into (dense layers'
        gate/up fused as in the MoE block)."""
        return stacked_target(name.removeprefix("model."), STACKED)

    def load_weights(self, source) -> None:
        """Load from a WeightSource; each rank reads only its slices and its own experts."""
        plain, moe_names, skipped_mtp = [], defaultdict(list), set()
        for name in source.names():
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            i = int(layer.group(1)) if layer else None
            if i is not None and i >= self.config.num_layers:
                skipped_mtp.add(i)  # multi-token-prediction layers: not used
            elif "rotary_emb" in name or (name.startswith("lm_head") and self.config.tie_word_embeddings):
                continue
            elif self.quant is not None and self.quant.ignores_tensor(name):
                continue
            elif i is not None and isinstance(self.layers[i].mlp, MoE) and ".mlp." in name:
                moe_names[i].append(name)  # the MoE block maps its own tensors (and skips other ranks' experts)
            else:
                plain.append(name)
        loaded = load_tensors(self, source, plain, self.checkpoint_target)
        for i, names in moe_names.items():
            self.layers[i].mlp.load_weights(source, names)
            loaded |= {f"layers.{i}.mlp.{n}" for n, _ in self.layers[i].mlp.named_parameters()}
        if skipped_mtp:
            logger.info("skipped the checkpoint's multi-token-prediction layers %s", sorted(skipped_mtp))
        require_loaded(self, loaded)
