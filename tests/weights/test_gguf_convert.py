"""GGUF → Hugging Face directory: the embedded default model, and a tiny GGUF written here."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from pdserve.tokenizer import Tokenizer
from pdserve.weights import WeightSource, convert_gguf, resolve_model_path
from pdserve.weights import default_model
from pdserve.weights.gguf_convert import unpermute_rows
from pdserve.weights.gguf_tokenizer import GGUFVocab, build_tokenizer

KNOWN_DEFAULT_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

ENCODE_SAMPLES = [
    "Hello, world!",
    "1234567890 and 3.14159",
    "東京は日本の首都です。中文也可以",
    "emoji 🎉👍🏽 family 👨‍👩‍👧 done",
    "  leading\t\ttabs\n\n\nand   runs of   spaces  \n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't I'll we've THEY'RE",
]


def test_default_model_config_matches_known_facts(default_model_dir):
    config = json.loads((Path(default_model_dir) / "config.json").read_text())
    assert {k: config[k] for k in KNOWN_DEFAULT_CONFIG} == KNOWN_DEFAULT_CONFIG
    assert json.loads((Path(default_model_dir) / "generation_config.json").read_text())["eos_token_id"] == 2


def test_default_model_tokenizer_config_has_chat_template_and_special_tokens(default_model_dir):
    tok_config = json.loads((Path(default_model_dir) / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == "<|im_start|>"
    assert tok_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>assistant" in tok_config["chat_template"]


def test_default_model_has_every_weight_once(default_model_dir):
    names = WeightSource(default_model_dir).names()
    assert len(names) == 1 + 1 + 30 * 9  # embeddings, final norm, 9 per layer; lm_head is tied
    assert "lm_head.weight" not in names


@pytest.fixture(scope="module")
def hf_model_and_tokenizer(default_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(default_model_dir)


def test_transformers_greedy_answer_names_paris(hf_model_and_tokenizer):
    """Wrong q/k un-permutation scrambles rotary pairs and the model stops answering sensibly."""
    model, hf_tok = hf_model_and_tokenizer
    prompt = hf_tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = torch.tensor([hf_tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    answer = hf_tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
    assert "Paris" in answer


@pytest.fixture(scope="module")
def ours(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.mark.parametrize("text", ENCODE_SAMPLES)
def test_hf_tokenizer_and_ours_encode_identically(hf_model_and_tokenizer, ours, text):
    _, hf_tok = hf_model_and_tokenizer
    assert ours.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text


def test_default_tokenizer_splits_digits_individually(ours):
    """tokenizer.ggml.pre = smollm: every digit is its own pre-token, as in llama.cpp."""
    assert [ours.decode([i]) for i in ours.encode("2024")] == ["2", "0", "2", "4"]
    assert ours.encode("<|im_start|>") == [1] and ours.encode("<|im_end|>") == [2]


def test_default_model_conversion_is_reused(default_model_dir, monkeypatch):
    model_file = Path(default_model_dir) / "model.safetensors"
    before = model_file.stat()

    def must_not_convert(*args, **kwargs):
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(default_model, "convert_gguf", must_not_convert)
    assert resolve_model_path(None) == Path(default_model_dir)
    assert resolve_model_path("default") == Path(default_model_dir)
    after = model_file.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_unpermute_inverts_llama_cpp_permute(permute_like_llama_cpp):
    w = np.arange(9 * 64 * 5, dtype=np.float32).reshape(9 * 64, 5)
    assert np.array_equal(unpermute_rows(permute_like_llama_cpp(w, 9), 9), w)
    assert not np.array_equal(permute_like_llama_cpp(w, 9), w)


def test_tiny_gguf_round_trips_every_tensor_exactly(tiny_gguf, tmp_path):
    out = convert_gguf(tiny_gguf.path, tmp_path / "model")
    weights = WeightSource(out)
    assert sorted(weights.names()) == sorted(tiny_gguf.hf_tensors)
    for name, expected in tiny_gguf.hf_tensors.items():
        assert np.array_equal(weights.get(name).numpy(), expected), name
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    heads = (config["num_attention_heads"], config["num_key_value_heads"])
    assert heads == (tiny_gguf.heads, tiny_gguf.kv_heads)
    assert config["rms_norm_eps"] == 1e-6


def test_gguf_without_output_tensor_ties_embeddings(make_tiny_gguf, tmp_path):
    tiny = make_tiny_gguf(tmp_path / "tied.gguf", with_output=False)
    out = convert_gguf(tiny.path, tmp_path / "model")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in WeightSource(out).names()


def test_tiny_gguf_tokenizer_uses_merges_specials_and_chat_template(tiny_gguf, tmp_path):
    tok = Tokenizer(convert_gguf(tiny_gguf.path, tmp_path / "model"))
    ids = tok.encode("hello the 12<|im_end|>")
    assert [tok.id_to_token(i) for i in ids] == ["hell", "o", "Ġthe", "Ġ", "1", "2", "<|im_end|>"]
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.is_special(2)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"


def test_convert_refuses_to_replace_an_existing_directory(tiny_gguf, tmp_path):
    out = convert_gguf(tiny_gguf.path, tmp_path / "model")
    stamp = (out / "config.json").stat().st_mtime_ns
    with pytest.raises(FileExistsError):
        convert_gguf(tiny_gguf.path, out)
    assert (out / "config.json").stat().st_mtime_ns == stamp
    convert_gguf(tiny_gguf.path, out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "tiny.gguf"]  # no temp leftovers


def test_gguf_path_is_converted_once_into_the_cache(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    first = resolve_model_path(str(tiny_gguf.path))
    assert first.parent == tmp_path / "cache" / "models" and (first / "config.json").is_file()

    def must_not_convert(*args, **kwargs):
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(default_model, "convert_gguf", must_not_convert)
    assert resolve_model_path(tiny_gguf.path) == first


def test_concurrent_conversions_agree_on_one_directory(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    results: list[Path] = []
    errors: list[BaseException] = []

    def resolve() -> None:
        try:
            results.append(resolve_model_path(tiny_gguf.path))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=resolve) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(results)) == 1
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [results[0].name]
    assert sorted(WeightSource(results[0]).names()) == sorted(tiny_gguf.hf_tensors)


def test_model_directory_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(tmp_path / "missing")


def test_unknown_pre_tokenizer_is_an_error():
    vocab = GGUFVocab(model="gpt2", pre="made-up", tokens=["a", "b"], token_types=[1, 1], merges=[])
    with pytest.raises(ValueError, match="made-up"):
        build_tokenizer(vocab)


def test_stale_temporary_conversions_are_removed(tiny_gguf, tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    target = default_model.converted_dir_for(tiny_gguf.path)
    stale, fresh = target.parent / f".{target.name}.tmp-dead", target.parent / f".{target.name}.tmp-live"
    for d in (stale, fresh):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"partial")
    os.utime(stale, (0, 0))  # last touched in 1970: its writer is long gone
    resolve_model_path(tiny_gguf.path)
    assert not stale.exists() and fresh.exists()
