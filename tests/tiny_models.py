"""Tiny random models of the DeepSeek family, written by transformers (the reference)."""
from __future__ import annotations

import torch

DEEPSEEK_COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=16,
    qk_nope_head_dim=16, first_k_dense_replace=1, max_position_embeddings=1024, eos_token_id=2,
    bos_token_id=1)
DSA = dict(index_topk=16, index_head_dim=32, index_n_heads=8)
DEEPSEEK_KINDS = {  # name → (config class name, extra config)
    "deepseek-v3": ("DeepseekV3Config", dict(n_group=4, topk_group=2)),
    "deepseek-v3.2": ("DeepseekV32Config", dict(DSA, n_group=4, topk_group=2)),
    # V3 as published: YaRN rope scaling (mscale on cos/sin and the softmax scale); and no q LoRA
    "deepseek-v3-yarn": ("DeepseekV3Config", dict(n_group=4, topk_group=2, q_lora_rank=None, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 16})),
    "glm-5": ("GlmMoeDsaConfig", dict(DSA)),
    "glm-5-shared": ("GlmMoeDsaConfig", dict(DSA, index_topk_pattern="FSF")),
}


def make_deepseek(path, kind: str, **overrides) -> str:
    """A tiny random model of a DeepSeek-family architecture (3 layers: 1 dense, 2 MoE with 8
    experts, top-2), saved by transformers; the router bias is random so bias correction matters."""
    import transformers

    cls, extra = DEEPSEEK_KINDS[kind]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls)(**{**DEEPSEEK_COMMON, **extra, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.1)
        model.lm_head.weight.mul_(8.0)  # sharper logits: fewer near-ties between the top two tokens
    model.save_pretrained(path)
    return str(path)
