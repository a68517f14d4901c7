"""Fixtures of the structured-output tests: the default model's tokenizer (real token bytes)
on a tiny random Llama, so that grammars meet a real vocabulary at the speed of a tiny model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.structured import Grammars
from pdserve.structured.factory import grammars_for_tokenizer
from pdserve.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="session")
def json_llama_dir(tmp_path_factory, default_model_dir: str) -> str:
    """A 2-layer random Llama (8 heads, 4 KV heads: TP=2 shards it) with SmolLM2's vocabulary
    and tokenizer files."""
    import transformers

    path = tmp_path_factory.mktemp("json-llama")
    cfg = json.loads((Path(default_model_dir) / "config.json").read_text())
    torch.manual_seed(0)
    model_cfg = transformers.LlamaConfig(vocab_size=cfg["vocab_size"], hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                         max_position_embeddings=1024, eos_token_id=cfg["eos_token_id"],
                                         bos_token_id=cfg["bos_token_id"], tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(model_cfg, dtype=torch.float32)
    with torch.no_grad():  # sharper logits: fewer near-ties between the top two tokens
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(default_model_dir) / name, path / name)
    return str(path)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: str) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.fixture
def grammars(tokenizer: Tokenizer) -> Grammars:
    """A fresh cache (the backend's tokenizer table is rebuilt: ~0.3 s)."""
    return grammars_for_tokenizer(tokenizer)
