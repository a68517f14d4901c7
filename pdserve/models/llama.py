"""The Llama family: Llama 2/3 and SmolLM2, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

GQA, RoPE (with llama3 scaling), RMSNorm, SwiGLU, optionally tied embeddings. Projections are
TP-sharded: q/k/v and gate/up column-parallel, o and down row-parallel (one all_reduce each).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

import pdserve_kernels as ops
from pdserve.distributed import TPGroup
from pdserve.kvcache import CacheTensorSpec
from pdserve.layers.attention import Attention, AttentionMetadata
from pdserve.layers.embedding import Embedding, LMHead
from pdserve.layers.linear import QKVParallelLinear, RowParallelLinear
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.norm import RMSNorm
from pdserve.layers.quant import QuantConfig, linear_method
from pdserve.layers.quant.blocks import BlockQuantLinearMethod
from pdserve.layers.rotary import RotaryEmbedding
from pdserve_kernels.layer_blocks import LayerStack, StackLayer

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


@dataclass
class FusedStep:
    """Per-step inputs of the fused layer blocks, shared by every layer: RoPE's cos/sin rows
    `[tokens, head_dim/2]`, int64 block tables, context lengths and query starts."""

    meta: AttentionMetadata
    cos: torch.Tensor
    sin: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    starts: torch.Tensor | None  # query_start_loc as int64; None when every sequence has one new token
    packed: bool  # multiply by the packed Q4 weights (the int16 path) where layers have them
    stack: LayerStack | None  # every layer in one call (TP = 1), else None: layer by layer


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


def _summing(proj: RowParallelLinear) -> TPGroup | None:
    """The TP group that sums a row-parallel projection's output (None: there is no sum, as at
    TP = 1, so the layers can run in one native call)."""
    return proj.tp if proj.reduce and proj.tp.size > 1 else None


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig, layer_idx: int, tp: TPGroup, quant: QuantConfig | None = None,
                 rotary: RotaryEmbedding | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(c, layer_idx, tp, quant, rotary)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, f"model.layers.{layer_idx}.mlp", tp, quant)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self._fused_args: tuple | None = None  # fused_args(), kept after the first fused step

    def can_fuse(self) -> bool:
        """Whether this layer's shape fits the fused layer blocks: every projection in GGUF
        blocks, no biases, no q/k norm, rotate-half RoPE, fp32 norms."""
        a, m = self.self_attn, self.mlp
        linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        return (all(isinstance(l.method, BlockQuantLinearMethod) and l.bias is None for l in linears)
                and not a.qk_norm and not a.rotary.interleaved
                and self.input_layernorm.weight.dtype == self.post_attention_layernorm.weight.dtype == torch.float32)

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None, step: "FusedStep"
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` in two native calls (pdserve_kernels.layer_blocks),
        the tensor-parallel sums between them as in `forward`."""
        if self._fused_args is None:  # the same every step: gathered once, not 30 lookups a layer
            self._fused_args = self.fused_args()
        attn, mlp, attn_packed, mlp_packed, attn_tp, mlp_tp = self._fused_args
        cache = step.meta.kv_caches[self.self_attn.attn.layer_idx]
        y = ops.attention_block(  # x += residual: x becomes the residual stream
            x, residual, *attn[0], step.cos, step.sin, cache["k"], cache["v"], step.meta.slot_mapping,
            step.tables, step.lens, step.starts, *attn[1], *(attn_packed if step.packed else (None, None)))
        if attn_tp is not None:
            y = attn_tp.all_reduce(y)
        z = ops.mlp_block(y, x, *mlp, *(mlp_packed if step.packed else (None, None)))
        if mlp_tp is not None:
            z = mlp_tp.all_reduce(z)
        return z, y  # y now holds x + attention: the residual stream

    def fused_args(self) -> tuple:
        """What `fused` passes besides the step's tensors: weights, formats, packed copies, and
        the TP group of each row-parallel projection that sums its output (None: no sum)."""
        a, m = self.self_attn, self.mlp
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        attn = ((n1.weight, n1.eps, a.qkv_proj.weight, a.qkv_proj.method.fmt, a.o_proj.weight,
                 a.o_proj.method.fmt), (a.num_heads, a.num_kv_heads, a.attn.scale))
        mlp = (n2.weight, n2.eps, m.gate_up_proj.weight, m.gate_up_proj.method.fmt, m.down_proj.weight,
               m.down_proj.method.fmt)
        return (attn, mlp, (a.qkv_proj.packed, a.o_proj.packed), (m.gate_up_proj.packed, m.down_proj.packed),
                _summing(a.o_proj), _summing(m.down_proj))

    def stack_layer(self, cache: dict[str, torch.Tensor]) -> StackLayer | None:
        """This layer for `fused_layers` (None when a projection sums over TP ranks)."""
        if self._fused_args is None:
            self._fused_args = self.fused_args()
        attn, (n2, eps2, gu, gu_fmt, down, down_fmt), attn_packed, mlp_packed, attn_tp, mlp_tp = self._fused_args
        (n1, eps1, qkv, qkv_fmt, o, o_fmt), _ = attn
        if attn_tp is not None or mlp_tp is not None or eps1 != eps2:
            return None
        return StackLayer(n1, n2, (qkv, o, gu, down), (qkv_fmt, o_fmt, gu_fmt, down_fmt),
                          (*attn_packed, *mlp_packed), cache["k"], cache["v"])

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
        self._fusable: bool | None = None  # every layer fits the fused layer blocks (set on first use)
        self._stack: tuple[object, bool, LayerStack | None] | None = None  # (KV caches, packed, stack)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(ids), None
        step = self.fused_step(x, positions, meta)
        if step is not None and step.stack is not None:  # every layer and the final norm: one call
            return ops.fused_layers(x, step.stack, step.cos, step.sin, meta.slot_mapping, step.tables, step.lens,
                                    step.starts)
        for layer in self.layers:
            if step is not None:
                x, residual = layer.fused(x, residual, step)
            else:
                x, residual = layer(x, residual, positions, meta)
        return self.norm(x, residual)[0]

    def fused_step(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                   ) -> "FusedStep | None":
        """What the fused layer blocks read, once per step; None when this step takes the
        op-by-op path (not an fp32 CPU batch, the fused ops not native here, or a
        layer shape they do not cover)."""
        if self._fusable is None:
            self._fusable = all(layer.can_fuse() for layer in self.layers)
        n = len(meta.context_lens)
        if not (self._fusable and ops.is_native(ops.attention_block) and x.device.type == "cpu"
                and x.dtype == torch.float32 and n and meta.query_start_loc[-1] == x.shape[0]
                and meta.kv_caches[0]["k"].dtype in (torch.float32, torch.float16)):  # --kv-cache-dtype
            return None
        cos, sin = self.layers[0].self_attn.rotary.cos_sin(positions)
        packed = ops.is_native(ops.qmatmul_packed)
        starts = None if x.shape[0] == n else torch.tensor(meta.query_start_loc, dtype=torch.int64)
        return FusedStep(meta, cos[:, 0], sin[:, 0], meta.block_tables.to(torch.int64).contiguous(),
                         torch.tensor(meta.context_lens, dtype=torch.int64), starts, packed,
                         self.layer_stack(meta.kv_caches, packed) if ops.is_native(ops.fused_layers) else None)

    def layer_stack(self, kv_caches: list[dict[str, torch.Tensor]], packed: bool) -> LayerStack | None:
        """The layers for `fused_layers`, gathered once per KV cache; None when a layer sums over
        TP ranks between its blocks or the norms differ in eps (then `fused` runs layer by layer)."""
        if self._stack is not None and self._stack[0] is kv_caches and self._stack[1] == packed:
            return self._stack[2]
        layers = [layer.stack_layer(kv_caches[i]) for i, layer in enumerate(self.layers)]
        stack = None
        if all(l is not None for l in layers) and len({layer.input_layernorm.eps for layer in self.layers}
                                                      | {self.norm.eps}) == 1:
            a = self.layers[0].self_attn
            stack = LayerStack(layers, self.norm.weight, self.norm.eps, a.num_heads, a.num_kv_heads, a.head_dim,
                               self.layers[0].mlp.gate_up_proj.weight.shape[0] // 2, a.attn.scale, packed)
        self._stack = (kv_caches, packed, stack)
        return stack


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
