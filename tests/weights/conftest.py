"""A tiny llama GGUF written in the test, laid out the way llama.cpp's converter writes one."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest

from pdserve.tokenizer import gpt2_unicode_to_byte

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, FFN = 16, 4, 2, 4, 2, 32
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "Ġ t", "Ġt he", "l l", "he ll"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (the HF → GGUF direction)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class TinyGGUF:
    path: Path
    hf_tensors: dict[str, np.ndarray]  # what the conversion must give back
    vocab_size: int
    heads: int = HEADS
    kv_heads: int = KV_HEADS


def _vocab() -> list[str]:
    by_byte = sorted(gpt2_unicode_to_byte().items(), key=lambda kv: kv[1])
    tokens = SPECIALS + [ch for ch, _ in by_byte]
    return tokens + ["he", "Ġt", "Ġthe", "ll", "hell"]


def write_tiny_gguf(path: Path, with_output: bool = True, seed: int = 0) -> TinyGGUF:
    rng = np.random.default_rng(seed)
    tokens = _vocab()
    vocab = len(tokens)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    hf = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    gg = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"]}
    if with_output:
        hf["lm_head.weight"] = gg["output.weight"] = rand(vocab, HIDDEN)
    for i in range(LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        layer = {
            "self_attn.q_proj.weight": ("attn_q.weight", rand(HEADS * HEAD_DIM, HIDDEN)),
            "self_attn.k_proj.weight": ("attn_k.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN)),
            "self_attn.v_proj.weight": ("attn_v.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN)),
            "self_attn.o_proj.weight": ("attn_output.weight", rand(HIDDEN, HEADS * HEAD_DIM)),
            "mlp.gate_proj.weight": ("ffn_gate.weight", rand(FFN, HIDDEN)),
            "mlp.up_proj.weight": ("ffn_up.weight", rand(FFN, HIDDEN)),
            "mlp.down_proj.weight": ("ffn_down.weight", rand(HIDDEN, FFN)),
            "input_layernorm.weight": ("attn_norm.weight", rand(HIDDEN)),
            "post_attention_layernorm.weight": ("ffn_norm.weight", rand(HIDDEN)),
        }
        for hf_name, (gg_name, w) in layer.items():
            hf[p + hf_name] = w
            if gg_name == "attn_q.weight":
                w = llama_cpp_permute(w, HEADS)
            elif gg_name == "attn_k.weight":
                w = llama_cpp_permute(w, KV_HEADS)
            gg[b + gg_name] = w

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "llama.block_count": LAYERS, "llama.context_length": 256, "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS, "llama.vocab_size": vocab,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }.items():
        writer.add_uint32(key, value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
    writer.add_array("tokenizer.ggml.merges", MERGES)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", TEMPLATE)
    for name, w in gg.items():
        writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path=path, hf_tensors=hf, vocab_size=vocab)


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> TinyGGUF:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def make_tiny_gguf() -> Callable[..., TinyGGUF]:
    """The writer itself, for tests that need a variant (no lm_head, another seed)."""
    return write_tiny_gguf


@pytest.fixture
def permute_like_llama_cpp() -> Callable[[np.ndarray, int], np.ndarray]:
    return llama_cpp_permute
