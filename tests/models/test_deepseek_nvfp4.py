"""A GLM-5 (MLA + MoE + DSA) NVFP4 checkpoint in ModelOpt format — every MLA, indexer, expert
and shared-expert projection quantized — loads through the NVFP4 loader and computes (W4A16)
what transformers computes on the dequantized weights."""
from __future__ import annotations

import shutil

import torch
import transformers
from safetensors import safe_open

from pdserve_kernels.nvfp4.quantize import dequantize
from pdserve.models import load_model
from pdserve.quantize import quantize_nvfp4
from pdserve.weights import save_safetensors_dir
from tests.tiny_models import make_deepseek


def dequantized_copy(quantized, out):
    """The checkpoint with every NVFP4 weight decoded to fp32 and no quantization config."""
    tensors = {}
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if name.endswith(("weight_scale", "weight_scale_2", "input_scale")):
                continue
            t = f.get_tensor(name)
            if t.dtype == torch.uint8:
                t = dequantize(t, f.get_tensor(name + "_scale"), f.get_tensor(name + "_scale_2"))
            tensors[name] = t
    save_safetensors_dir(tensors, out)
    return out


def test_glm5_nvfp4_equals_transformers_on_dequantized_weights(tmp_path, all_logits):
    src = make_deepseek(tmp_path / "fp32", "glm-5")
    calib = [torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    q = quantize_nvfp4(src, tmp_path / "nvfp4", texts=calib)
    with safe_open(str(q / "model.safetensors"), "pt") as f:
        quantized = {n.removesuffix(".weight") for n in f.keys() if f.get_slice(n).get_dtype() == "U8"}
    for part in ("self_attn.kv_b_proj", "self_attn.indexer.wq_b", "mlp.experts.0.down_proj",
                 "mlp.shared_experts.gate_proj", "self_attn.q_a_proj"):
        assert any(n.endswith(part) for n in quantized), part
    deq = dequantized_copy(q, tmp_path / "deq")
    shutil.copy(src + "/config.json", deq / "config.json")
    hf = transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    ids = calib[0][:40]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = all_logits(load_model(q, nvfp4_mode="w4a16"), ids)
    assert (ours - ref).abs().max() < 1e-4
    plain = all_logits(load_model(src), ids)
    assert (ours - plain).abs().max() > 1e-3  # the 4-bit weights are really in use
