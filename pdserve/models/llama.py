"""The Llama family: Llama 2/3 and SmolLM2, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

GQA, RoPE (with llama3 scaling), RMSNorm, SwiGLU, optionally tied embeddings. Projections are
TP-sharded: q/k/v and gate/up column-parallel, o and down row-parallel (one all_reduce each).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.distributed import TPGroup
from pdserve.kvcache import CacheTensorSpec
from pdserve.layers.attention import Attention, AttentionMetadata
from pdserve.layers.embedding import Embedding, LMHead
from pdserve.layers.linear import QKVParallelLinear, RowParallelLinear
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.norm import RMSNorm
from pdserve.layers.quant import QuantConfig, linear_method
from pdserve.layers.rotary import RotaryEmbedding

from pdserve.weights.loading import load_tensors, require_loaded, stacked_target

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if kind == "default" else rope,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        )


class LlamaAttention(nn.Module):
    def __init__(self, c: LlamaConfig, layer_idx: int, tp: TPGroup, quant: QuantConfig | None = None,
                 rotary: RotaryEmbedding | None = None):
        super().__init__()
        p = f"model.layers.{layer_idx}.self_attn"
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads,
                                          bias=c.qkv_bias, tp=tp, method=linear_method(
                                              quant, [f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"]))
        self.o_proj = RowParallelLinear(c.num_heads * c.head_dim, c.hidden_size, bias=False, tp=tp,
                                        method=linear_method(quant, [f"{p}.o_proj"]))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = c.head_dim
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.qk_norm = c.qk_norm
        # shared by every layer (LlamaModel passes one): cos/sin are read once per step
        self.rotary = rotary or RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, c.head_dim,
                              scale=c.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h, kvh = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(-1, h + 2 * kvh, self.head_dim)
        v = qkv[:, h + kvh:]
        if self.qk_norm:
            q, k = self.rotary(positions, self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h:h + kvh]))
        else:  # q and k heads are neighbours in the fused projection: rotate them in one pass
            qk = self.rotary.rotate(positions, qkv[:, :h + kvh])
            q, k = qk[:, :h], qk[:, h:]
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig, layer_idx: int, tp: TPGroup, quant: QuantConfig | None = None,
                 rotary: RotaryEmbedding | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(c, layer_idx, tp, quant, rotary)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, f"model.layers.{layer_idx}.mlp", tp, quant)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, c: LlamaConfig, tp: TPGroup, quant: QuantConfig | None = None):
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, i, tp, quant, rotary) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, meta)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Entry point: `forward` gives hidden states, `compute_logits` the full-vocabulary logits.

    `quant` (a checkpoint's quantization config, e.g. pdserve.weights.nvfp4.NVFP4Config) picks
    each projection's LinearMethod; the embeddings and the LM head stay unquantized.
    """

    # checkpoint name part → (our module name part, shard id)
    stacked = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, hf_config: dict, tp: TPGroup = TPGroup(), quant: QuantConfig | None = None):
        super().__init__()
        c = self.config = LlamaConfig.from_hf(hf_config)
        self.tp = tp
        self.quant = quant
        self.model = LlamaModel(c, tp, quant)
        self.lm_head = LMHead(c.vocab_size, c.hidden_size, tp,
                              tied_to=self.model.embed_tokens if c.tie_word_embeddings else None)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def cache_spec(self, dtype: torch.dtype, index_dtype: torch.dtype | None = None
                   ) -> list[list[CacheTensorSpec]]:
        """Per layer: K and V per KV head (`index_dtype` is for sparse-attention models; Llama
        has no index)."""
        kv = self.model.layers[0].self_attn.num_kv_heads
        shape = (kv, self.config.head_dim)
        return [[CacheTensorSpec("k", shape, dtype), CacheTensorSpec("v", shape, dtype)]
                for _ in range(self.num_layers)]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def checkpoint_target(self, name: str) -> tuple[str, str, object]:
        """(module, parameter, shard id) that checkpoint tensor `name` loads into."""
        return stacked_target(name, self.stacked)

    def load_weights(self, source) -> None:
        """Load from a WeightSource; each layer reads only its TP slice."""
        tied = self.config.tie_word_embeddings
        names = [n for n in source.names()
                 if "rotary_emb" not in n and not (n.startswith("lm_head") and tied)
                 and not (self.quant is not None and self.quant.ignores_tensor(n))]
        loaded = load_tensors(self, source, names, self.checkpoint_target, strict=False)
        require_loaded(self, loaded)
