"""Tiny random Llama, Qwen2 and Qwen3 models: pdserve's logits equal transformers' (fp32)."""
from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.models import load_model

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

CONFIGS = {
    "llama": (transformers.LlamaConfig, dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "llama-tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True, rms_norm_eps=1e-5)),
    "llama3-rope": (transformers.LlamaConfig, dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, rope_theta=500000.0)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=True)),
}


def make_model(tmp_path, name: str) -> str:
    cls, extra = CONFIGS[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cls(**COMMON, **extra), dtype=torch.float32)
    hf.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(tmp_path, name, all_logits):
    path = make_model(tmp_path, name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = all_logits(load_model(path), ids)
    assert torch.allclose(ours[-1], ref[-1], atol=1e-4, rtol=0), (ours[-1] - ref[-1]).abs().max()
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0)


def test_chunked_prefill_equals_one_pass(tmp_path, all_logits):
    """Computing the prompt in chunks through the paged cache gives the same logits."""
    model = load_model(make_model(tmp_path, "qwen2"))
    ids = list(range(5, 62))
    whole = all_logits(model, ids)
    for chunk in (1, 7, 16):
        assert torch.allclose(all_logits(model, ids, chunk=chunk), whole, atol=1e-5)
