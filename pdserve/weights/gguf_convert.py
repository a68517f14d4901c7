"""Convert a llama-architecture GGUF file into a Hugging Face model directory.

The default model ships only as a quantized GGUF. Everything else in pdserve (and the
``transformers`` reference in the tests) reads Hugging Face directories, so we dequantize once
to fp32 safetensors and rebuild config, tokenizer and chat template from the GGUF metadata.

Beside the fp32 weights, ``gguf/`` keeps the GGUF's own blocks (Q4_0, Q4_1, Q8_0 tensors, as
uint8 rows of blocks under their Hugging Face names, q/k rows un-permuted like the fp32 ones)
with ``gguf/quant.json`` naming each tensor's format; pdserve runs them quantized
(``--quantization gguf``, see pdserve.weights.quantization). Other tensor types are stored there
dequantized to fp32 and run unquantized.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from pdserve.weights.gguf_tokenizer import GGUFVocab, build_tokenizer, tokenizer_config
from pdserve.weights.safetensors_io import save_safetensors_dir

logger = logging.getLogger(__name__)

# The output format's version is default_model.CONVERTER_VERSION (the cache key): bump it there
# whenever the output changes, so cached conversions are redone.
BLOCKS_DIR = "gguf"
BLOCKS_CONFIG = "quant.json"
# GGUF types kept as blocks (pdserve_kernels.quant); anything else is dequantized to fp32
KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Present in some llama GGUFs but derived from config in HF (rope_freqs: llama3 scaling).
_SKIPPED = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value fields of the GGUF as Python values (strings, numbers, lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face Llama name of a GGUF tensor; None for tensors HF does not store."""
    if gguf_name in _SKIPPED:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama equivalent")


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs back to HF's halves)."""
    out_features = weight.shape[0]
    head_dim = out_features // n_head
    rest = weight.shape[1:]
    return (
        weight.reshape(n_head, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(out_features, *rest)
    )


def _arch_key(meta: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    return meta.get(f"{arch}.{key}", default)


def hf_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """``config.json`` of a LlamaForCausalLM built from the GGUF hyperparameters."""
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUFs are supported, got {arch!r}")
    hidden = int(_arch_key(meta, arch, "embedding_length"))
    n_heads = int(_arch_key(meta, arch, "attention.head_count"))
    n_kv = int(_arch_key(meta, arch, "attention.head_count_kv", n_heads))
    head_dim = int(_arch_key(meta, arch, "attention.key_length", hidden // n_heads))
    vocab_size = int(_arch_key(meta, arch, "vocab_size", len(meta["tokenizer.ggml.tokens"])))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(_arch_key(meta, arch, "feed_forward_length")),
        "num_hidden_layers": int(_arch_key(meta, arch, "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": int(_arch_key(meta, arch, "context_length", 2048)),
        "rms_norm_eps": _f32(_arch_key(meta, arch, "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(_arch_key(meta, arch, "rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if (value := meta.get(f"tokenizer.ggml.{key}")) is not None:
            config[key] = int(value)
    return config


def _f32(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.99999974e-06; keep the short decimal."""
    return float(str(np.float32(value)))


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = _arch_key(meta, arch, "rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(_arch_key(meta, arch, "rope.scaling.factor"))}
    raise ValueError(f"rope scaling {kind!r} is not supported by the GGUF converter")


def gguf_vocab(meta: dict[str, Any]) -> GGUFVocab:
    def opt_int(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    return GGUFVocab(
        model=meta["tokenizer.ggml.model"],
        pre=meta.get("tokenizer.ggml.pre", "default"),
        tokens=meta["tokenizer.ggml.tokens"],
        token_types=meta.get("tokenizer.ggml.token_type") or [1] * len(meta["tokenizer.ggml.tokens"]),
        merges=meta.get("tokenizer.ggml.merges", []),
        bos_token_id=opt_int("bos_token_id"),
        eos_token_id=opt_int("eos_token_id"),
        unk_token_id=opt_int("unknown_token_id"),
        pad_token_id=opt_int("padding_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def iter_hf_tensors(reader: GGUFReader, config: dict[str, Any], blocks: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors under their Hugging Face names, q/k rows un-permuted: dequantized fp32, or with
    `blocks` the Q4_0/Q4_1/Q8_0 tensors as uint8 rows of blocks [out, in/32 * block bytes]."""
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            logger.warning("skipping GGUF tensor %s (not stored by Hugging Face Llama)", tensor.name)
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if blocks and tensor.tensor_type.name in KEPT_TYPES:
            # rows of raw blocks: the un-permutation below moves whole rows, so it applies as is
            array = np.array(tensor.data, dtype=np.uint8).reshape(shape[0], -1)
        else:
            # np.array copies: F32 tensors are read-only views of the memory-mapped file.
            array = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            array = array.reshape(shape)
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            array = unpermute_rows(array, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
            array = unpermute_rows(array, config["num_key_value_heads"])
        yield name, torch.from_numpy(np.ascontiguousarray(array))


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if key in config}


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face model directory for ``gguf_path`` at ``out_dir``, atomically.

    The directory is built next to ``out_dir`` and renamed into place, so a reader never sees
    half a model. If ``out_dir`` appears meanwhile (another process won a race) and
    ``overwrite`` is false, FileExistsError is raised and the existing directory is kept.
    """
    gguf_path, out = Path(gguf_path), Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_model_dir(gguf_path, tmp)
        _make_readable(tmp)
        _move_into_place(tmp, out, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s -> %s", gguf_path, out)
    return out


def _write_model_dir(gguf_path: Path, out: Path) -> None:
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = hf_config(meta, tied=not has_output)
    tensors = dict(iter_hf_tensors(reader, config))
    save_safetensors_dir(tensors, out, metadata={"source": gguf_path.name})
    del tensors
    _write_blocks_dir(reader, config, out / BLOCKS_DIR, gguf_path.name)
    vocab = gguf_vocab(meta)
    build_tokenizer(vocab).save(str(out / "tokenizer.json"))
    tok_config = tokenizer_config(vocab, model_max_length=config["max_position_embeddings"])
    _write_json(out / "tokenizer_config.json", tok_config)
    _write_json(out / "generation_config.json", generation_config(config))
    _write_json(out / "config.json", config)  # written last: its presence marks completeness


def _write_blocks_dir(reader: GGUFReader, config: dict[str, Any], out: Path, source: str) -> None:
    """gguf/: the GGUF's blocks under Hugging Face names, and quant.json naming their formats."""
    formats = {t.name: t.tensor_type.name for t in reader.tensors}
    names = {hf_tensor_name(n): f for n, f in formats.items() if n not in _SKIPPED}
    save_safetensors_dir(dict(iter_hf_tensors(reader, config, blocks=True)), out,
                         metadata={"source": source})
    kept = {name: fmt for name, fmt in sorted(names.items()) if fmt in KEPT_TYPES}
    _write_json(out / BLOCKS_CONFIG, {"format": "gguf-blocks", "source": source, "tensors": kept})


def _make_readable(model_dir: Path) -> None:
    """mkdtemp makes a private (0700) directory; a model directory is world-readable."""
    for folder, dirs, files in os.walk(model_dir):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    if overwrite and out.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, stale / "model")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError as exc:
        if out.exists():  # another process renamed its copy into place first
            raise FileExistsError(f"{out} already exists") from exc
        raise


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
