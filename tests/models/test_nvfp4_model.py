"""The default model (SmolLM2-135M-Instruct) quantized by `pdserve quantize --nvfp4`: it loads,
its perplexity stays near fp32 (W4A16 and W4A4 emulated), and it still knows Paris.

Perplexity text: the US Declaration of Independence and the Gettysburg Address (public domain;
tests/models/data/README.md), 2,024 tokens in independent windows of 512. Measured (torch 2.13,
CPU): fp32 20.62, W4A16 33.71 (1.63x), W4A4 45.94 (2.23x); over the whole text in one window:
18.78, 29.77, 40.39. SmolLM2-135M is small and our copy of it comes from a
Q4_1 GGUF, so 4-bit weights cost it more than they cost larger models; the bounds leave room
for that and still catch a broken format (perplexity in the hundreds or thousands).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.layers.quant import UnquantizedLinearMethod
from pdserve.layers.quant.nvfp4 import NVFP4LinearMethod
from pdserve.models import load_model
from pdserve.quantize import forward_tokens
from pdserve.tokenizer import Tokenizer

TEXT = Path(__file__).parent / "data" / "public_domain_en.txt"
WINDOW = 512
W4A16_BOUND, W4A4_BOUND = 1.8, 2.5  # x fp32 perplexity


def perplexity(model: torch.nn.Module, ids: list[int], window: int = WINDOW) -> float:
    """exp(mean NLL), the text cut into independent windows (attention cost stays small)."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        seg = ids[start:start + window + 1]
        hidden = forward_tokens(model, seg[:-1])
        with torch.inference_mode():
            logp = torch.log_softmax(model.compute_logits(hidden), dim=-1)
        nll -= float(logp.gather(1, torch.tensor(seg[1:])[:, None]).sum())
        count += len(seg) - 1
    return math.exp(nll / count)


def test_default_model_quantizes_to_nvfp4_layers(nvfp4_default_dir):
    model = load_model(nvfp4_default_dir)
    methods = [m.method for m in model.modules() if hasattr(m, "method")]
    assert len(methods) == 30 * 4 and all(isinstance(m, NVFP4LinearMethod) for m in methods)
    assert not any(isinstance(m, UnquantizedLinearMethod) for m in methods)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # embeddings (and tied head) kept
    size = sum(p.stat().st_size for p in Path(nvfp4_default_dir).glob("*.safetensors"))
    assert size < 200e6  # 538 MB in fp32: the linears shrink to 4.5 bits, embeddings stay


@pytest.mark.timeout(300)
def test_nvfp4_perplexity_stays_near_fp32(default_model_dir, nvfp4_default_dir):
    ids = Tokenizer(default_model_dir).encode(TEXT.read_text(encoding="utf-8"))
    assert len(ids) > 2000
    ids = ids[:2 * WINDOW + 1]  # two windows: enough tokens for a stable ratio, in half the time
    fp32 = perplexity(load_model(default_model_dir), ids)
    w4a16 = perplexity(load_model(nvfp4_default_dir, nvfp4_mode="w4a16"), ids)
    w4a4 = perplexity(load_model(nvfp4_default_dir, nvfp4_mode="w4a4"), ids)
    print(f"\nperplexity over {len(ids)} tokens: fp32 {fp32:.2f}, NVFP4 W4A16 {w4a16:.2f} "
          f"({w4a16 / fp32:.2f}x), W4A4 {w4a4:.2f} ({w4a4 / fp32:.2f}x)")
    assert fp32 < 40
    assert fp32 < w4a16 < W4A16_BOUND * fp32
    assert fp32 < w4a4 < W4A4_BOUND * fp32


def test_nvfp4_model_still_answers_paris(nvfp4_default_dir):
    llm = LLM(model=nvfp4_default_dir)
    out = llm.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=16),
                       chat=True)[0]
    assert "Paris" in out.text, out.text
