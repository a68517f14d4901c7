"""`--quantization`: the default model keeps its GGUF blocks (equal to the fp32 conversion once
dequantized) and still answers Paris; float checkpoints quantize on load; `auto` picks the blocks
only where they exist and run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.layers.quant import QuantConfigError, UnquantizedLinearMethod
from pdserve.layers.quant.blocks import BlockQuantLinearMethod
from pdserve.models import load_model
from pdserve.weights import WeightSource
from pdserve.weights.quantization import select
from pdserve_kernels.quant import Q4_1, Q8_0, block_format, dequantize


def test_default_model_keeps_its_gguf_formats(default_model_dir):
    formats = json.loads((Path(default_model_dir) / "gguf" / "quant.json").read_text())["tensors"]
    assert formats["model.embed_tokens.weight"] == "Q8_0"
    linears = {n: f for n, f in formats.items() if n.startswith("model.layers.")}
    assert len(linears) == 30 * 7 and set(linears.values()) == {"Q4_1"}


@pytest.mark.parametrize("layer", [0, 17, 29])
def test_blocks_dequantize_to_the_fp32_conversion_exactly(default_model_dir, layer):
    """The blocks (q/k rows un-permuted as blocks) equal gguf's own dequantizer's fp32 output."""
    blocks, fp32 = WeightSource(Path(default_model_dir) / "gguf"), WeightSource(default_model_dir)
    formats = json.loads((Path(default_model_dir) / "gguf" / "quant.json").read_text())["tensors"]
    names = [n for n in formats if n.startswith(f"model.layers.{layer}.")]
    if layer == 0:
        names.append("model.embed_tokens.weight")
    for name in names:
        raw = blocks.get(name)
        assert raw.dtype == torch.uint8, name
        assert torch.equal(dequantize(raw, block_format(formats[name])), fp32.get(name)), name
    assert torch.equal(blocks.get(f"model.layers.{layer}.input_layernorm.weight"),
                       fp32.get(f"model.layers.{layer}.input_layernorm.weight"))


@pytest.fixture(scope="module")
def q4_1_llm(default_model_dir):
    return LLM(EngineConfig(model=default_model_dir, quantization="gguf"))


def test_default_model_in_q4_1_answers_paris(q4_1_llm):
    model = q4_1_llm.engine.model
    methods = [m.method for m in model.modules() if hasattr(m, "method")]
    assert len(methods) == 30 * 4 and all(isinstance(m, BlockQuantLinearMethod) and m.fmt is Q4_1
                                          for m in methods)
    assert model.model.embed_tokens.fmt is Q8_0 and model.model.embed_tokens.weight.dtype == torch.uint8
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes < 100e6  # 538 MB in fp32
    c, = q4_1_llm.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=32),
                           chat=True)
    assert "Paris" in c.text
    assert c.finish_reason == "stop"


def test_auto_takes_the_blocks_on_cpu_only(default_model_dir, tiny_llama_dir):
    cfg = json.loads((Path(default_model_dir) / "config.json").read_text())
    quant, where = select(default_model_dir, cfg, "auto", "cpu")
    assert quant.quant_algo == "GGUF" and where == Path(default_model_dir) / "gguf"
    assert select(default_model_dir, cfg, "auto", "cuda") == (None, Path(default_model_dir))
    assert select(default_model_dir, cfg, "none", "cpu") == (None, Path(default_model_dir))
    tiny_cfg = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    assert select(tiny_llama_dir, tiny_cfg, "auto", "cpu") == (None, Path(tiny_llama_dir))
    with pytest.raises(FileNotFoundError, match="was not converted from a GGUF"):
        select(tiny_llama_dir, tiny_cfg, "gguf", "cpu")


@pytest.mark.parametrize("kind,fmt,bound", [("int8", Q8_0, 0.02), ("int4", Q4_1, 0.25)])
def test_float_model_quantized_on_load_stays_near_fp32(tiny_llama_dir, all_logits, kind, fmt, bound):
    """Relative logit error of the tiny random model: int8 ~0.5 %, int4 ~8 % (random weights have
    no outliers to spare, so these bounds only catch a broken format)."""
    ids = list(range(3, 40))
    ref = all_logits(load_model(tiny_llama_dir), ids)
    model = load_model(tiny_llama_dir, quantization=kind)
    methods = [m.method for m in model.modules() if hasattr(m, "method")]
    assert methods and all(isinstance(m, BlockQuantLinearMethod) and m.fmt is fmt for m in methods)
    assert model.model.embed_tokens.fmt is Q8_0
    ours = all_logits(model, ids)
    assert float((ours - ref).norm() / ref.norm()) < bound


def test_on_load_quantization_of_an_nvfp4_checkpoint_is_refused(tmp_path, tiny_llama_dir):
    cfg = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    with pytest.raises(QuantConfigError, match="NVFP4 checkpoint already"):
        select(tiny_llama_dir, cfg, "int8", "cpu")


def test_unquantized_stays_the_default_of_the_engine(default_model_dir):
    assert EngineConfig().quantization == "none"
    model = load_model(default_model_dir)
    assert all(isinstance(m.method, UnquantizedLinearMethod) for m in model.modules() if hasattr(m, "method"))


def test_a_new_conversion_removes_older_converter_versions(tiny_gguf, tmp_path, monkeypatch):
    from pdserve.weights import default_model, resolve_model_path

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    target = default_model.converted_dir_for(tiny_gguf.path)
    stale = target.parent / target.name.replace(f"-v{target.name.rpartition('-v')[2]}", "-v1")
    other = target.parent / "another-model-0123456789abcdef-v1"
    for d in (stale, other):
        (d / "x").mkdir(parents=True)
    assert resolve_model_path(str(tiny_gguf.path)) == target
    assert not stale.exists() and other.exists()
    assert (target / "gguf" / "quant.json").is_file()
