"""ModelOpt NVFP4 checkpoints: our quantizer's output, both config forms, exclude lists, fused
scales, clear errors, and (when installed) NVIDIA ModelOpt's own export of the same tiny model."""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import pdserve_kernels.nvfp4 as fp4
from pdserve.distributed import TPGroup
from pdserve.layers.quant import UnquantizedLinearMethod
from pdserve.layers.quant.nvfp4 import NVFP4LinearMethod
from pdserve.models import load_model
from pdserve.quantize import add_quantize_parser, calibrate, quantize_nvfp4
from pdserve.weights import WeightSource, save_safetensors_dir
from pdserve.weights.nvfp4 import (
    QuantConfigError,
    detect,
    parse_hf_quant_config,
    parse_quantization_config,
    quantize_with_scale_2,
    unify_fused_scales,
)

MODELOPT_PIP = "nvidia-modelopt==0.47.0 omegaconf==2.4.0 PuLP==3.3.2 scipy==1.17.1"
ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"


def calib_ids() -> list[list[int]]:
    """Three random 40-token sequences of the tiny model's 300-token vocabulary."""
    return [torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(3)]


@pytest.fixture(scope="module")
def tiny_nvfp4(tiny_llama_dir, tmp_path_factory) -> str:
    return str(quantize_nvfp4(tiny_llama_dir, tmp_path_factory.mktemp("tiny-nvfp4") / "q", calib_ids()))


def rewrite(src: str, out: Path, tensors: Callable[[dict], None] | None = None,
            hf_quant: Callable[[dict], None] | None = None,
            config: Callable[[dict], None] | None = None) -> str:
    """A copy of checkpoint `src` with its tensors and config files edited in place."""
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    data = dict(WeightSource(src))
    if tensors:
        tensors(data)
    save_safetensors_dir(data, out)
    for name, edit in (("hf_quant_config.json", hf_quant), ("config.json", config)):
        if edit:
            path = out / name
            content = json.loads(path.read_text())
            edit(content)
            path.write_text(json.dumps(content)) if content else path.unlink()
    return str(out)


def logits(model_dir: str, all_logits, mode: str = "auto") -> torch.Tensor:
    return all_logits(load_model(model_dir, nvfp4_mode=mode), calib_ids()[0])


# ---- what the quantizer writes ------------------------------------------------------------

def test_quantizer_writes_both_config_forms(tiny_nvfp4):
    hf_quant = json.loads((Path(tiny_nvfp4) / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"] == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                        "group_size": 16,
                                        "exclude_modules": ["lm_head", "model.embed_tokens"]}
    qc = json.loads((Path(tiny_nvfp4) / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert qc["ignore"] == ["lm_head", "model.embed_tokens"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 16
    assert parse_hf_quant_config(hf_quant).exclude == parse_quantization_config(qc).exclude


def test_quantized_tensors_follow_modelopt_formulas(tiny_llama_dir, tiny_nvfp4):
    src, q = WeightSource(tiny_llama_dir), WeightSource(tiny_nvfp4)
    # unfused layers: exactly the reference quantize_weight
    for part in (f"{ATTN}.o_proj", f"{MLP}.down_proj"):
        ref = fp4.quantize_weight(src.get(f"{part}.weight"))
        assert torch.equal(q.get(f"{part}.weight"), ref.weight)
        assert torch.equal(q.get(f"{part}.weight_scale").view(torch.uint8),
                           ref.weight_scale.view(torch.uint8))
        assert torch.equal(q.get(f"{part}.weight_scale_2"), ref.weight_scale_2)
    # fused parts share weight_scale_2 = max amax / (6 * 448), as ModelOpt's export does
    for parts in ([f"{ATTN}.{p}_proj" for p in "qkv"], [f"{MLP}.gate_proj", f"{MLP}.up_proj"]):
        amax = max(src.get(f"{p}.weight").abs().max() for p in parts)
        for p in parts:
            assert torch.equal(q.get(f"{p}.weight_scale_2"), amax / (6 * 448))
            ref = quantize_with_scale_2(src.get(f"{p}.weight"), amax / (6 * 448))
            assert torch.equal(q.get(f"{p}.weight"), ref.weight)
    # static input_scale = calibration amax / (6 * 448); q, k, v share it
    amax = calibrate(load_model(tiny_llama_dir), Path(tiny_llama_dir), calib_ids())
    for p in "qkv":
        assert q.get(f"{ATTN}.{p}_proj.input_scale") == torch.tensor(amax[f"{ATTN}.qkv_proj"] / 2688.0)
    assert q.get(f"{MLP}.down_proj.input_scale") == torch.tensor(amax[f"{MLP}.down_proj"] / 2688.0)
    assert "lm_head.weight" in q and q.get("lm_head.weight").dtype == torch.float32


def test_loaded_layers_compute_the_reference_ops(tiny_nvfp4):
    q = WeightSource(tiny_nvfp4)
    parts = [f"{ATTN}.{p}_proj" for p in "qkv"]
    w = torch.cat([q.get(f"{p}.weight") for p in parts])
    ws = torch.cat([q.get(f"{p}.weight_scale") for p in parts])
    s2, s_in = q.get(f"{ATTN}.q_proj.weight_scale_2"), q.get(f"{ATTN}.q_proj.input_scale")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    w4a16 = load_model(tiny_nvfp4, nvfp4_mode="w4a16").model.layers[0].self_attn.qkv_proj
    torch.testing.assert_close(w4a16(x), fp4.nvfp4_linear_w4a16(x, w, ws, s2), rtol=1e-6, atol=1e-7)
    w4a4 = load_model(tiny_nvfp4, nvfp4_mode="w4a4").model.layers[0].self_attn.qkv_proj
    assert torch.equal(w4a4(x), fp4.nvfp4_linear_w4a4(x, w, ws, s2, s_in))


def test_nvfp4_logits_stay_close_to_fp32(tiny_llama_dir, tiny_nvfp4, all_logits):
    ref = logits(tiny_llama_dir, all_logits)
    for mode, worst in (("w4a16", 0.98), ("w4a4", 0.95)):  # measured: 0.985, 0.970
        got = logits(tiny_nvfp4, all_logits, mode)
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        print(mode, cos.min(), cos.mean())
        assert cos.min() > worst and cos.mean() > 0.98, (mode, cos.min(), cos.mean())


def test_scales_are_swizzled_once_for_the_sm120_path(tiny_nvfp4):
    layer = load_model(tiny_nvfp4).model.layers[0].mlp.gate_up_proj
    assert layer.method.backend == "w4a16"  # no GPU here: dequantized once at load
    layer.method._prepare_sm120(layer, torch.bfloat16)  # what `finish` does on an SM120 GPU
    rows, k_blocks = layer.weight_scale.shape
    back = fp4.unswizzle_scales(layer.weight_scale_swizzled, rows, k_blocks)
    assert torch.equal(back.view(torch.uint8), layer.weight_scale.view(torch.uint8))
    assert layer.weight_scale_swizzled.numel() == fp4.swizzled_size(rows, k_blocks)


def test_tensor_parallel_ranks_load_their_slices(tiny_nvfp4):
    """TP=2: column-parallel parts split their rows, row-parallel layers their packed columns
    and scale blocks; the ranks' partial products of down_proj sum to the whole."""
    q = WeightSource(tiny_nvfp4)
    full = load_model(tiny_nvfp4).model.layers[0].mlp.down_proj
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    partial = []
    for rank in (0, 1):
        layer0 = load_model(tiny_nvfp4, tp=TPGroup(rank, 2)).model.layers[0]
        qkv, gate_up, down = layer0.self_attn.qkv_proj, layer0.mlp.gate_up_proj, layer0.mlp.down_proj
        rows = {"q": 32, "k": 16, "v": 16}  # 4 heads / 2 KV heads of 16 dims, per rank
        want = torch.cat([q.get(f"{ATTN}.{p}_proj.weight")[rank * n:(rank + 1) * n] for p, n in rows.items()])
        assert torch.equal(qkv.weight, want)
        want = torch.cat([q.get(f"{MLP}.{p}_proj.weight")[rank * 64:(rank + 1) * 64] for p in ("gate", "up")])
        assert torch.equal(gate_up.weight, want)
        assert torch.equal(down.weight, q.get(f"{MLP}.down_proj.weight")[:, rank * 32:(rank + 1) * 32])
        want = q.get(f"{MLP}.down_proj.weight_scale")[:, rank * 4:(rank + 1) * 4]
        assert torch.equal(down.weight_scale.view(torch.uint8), want.view(torch.uint8))
        partial.append(down.method.apply(down, x[:, rank * 64:(rank + 1) * 64], None))
    torch.testing.assert_close(partial[0] + partial[1], full(x), rtol=1e-5, atol=1e-6)


def test_kv_cache_scales_are_read_past(tiny_nvfp4, tmp_path, all_logits):
    """An FP8-KV checkpoint loads with the KV cache in the model dtype (a warning says so)."""
    def add_kv_scales(t: dict) -> None:
        t[f"{ATTN}.k_proj.k_scale"], t[f"{ATTN}.v_proj.v_scale"] = torch.tensor(0.01), torch.tensor(0.02)

    fp8_kv = rewrite(tiny_nvfp4, tmp_path / "kv", add_kv_scales,
                     hf_quant=lambda c: c["quantization"].update(kv_cache_quant_algo="FP8"),
                     config=lambda c: c["quantization_config"].update(
                         kv_cache_scheme={"dynamic": False, "num_bits": 8, "type": "float"}))
    assert detect(fp8_kv).kv_cache_quant_algo == "FP8"
    assert torch.equal(logits(fp8_kv, all_logits), logits(tiny_nvfp4, all_logits))


# ---- both config forms --------------------------------------------------------------------

def test_either_config_form_alone_loads_the_same_model(tiny_nvfp4, tmp_path, all_logits):
    only_old = rewrite(tiny_nvfp4, tmp_path / "old", config=lambda c: c.pop("quantization_config"))
    only_new = rewrite(tiny_nvfp4, tmp_path / "new", hf_quant=lambda c: c.clear())
    assert detect(only_old).source.endswith("hf_quant_config.json")
    assert detect(only_new).source.endswith("quantization_config")
    both = logits(tiny_nvfp4, all_logits)
    assert torch.equal(logits(only_old, all_logits), both)
    assert torch.equal(logits(only_new, all_logits), both)


# ---- exclude lists ------------------------------------------------------------------------

def test_exclude_patterns_match_wildcards_and_parent_modules():
    cfg = parse_hf_quant_config({"quantization": {"quant_algo": "NVFP4", "exclude_modules": [
        "lm_head", "model.layers.1*", "*.mlp.down_proj", "model.layers.3.self_attn"]}})
    assert cfg.is_excluded("lm_head")
    assert cfg.is_excluded("model.layers.1.mlp.gate_proj") and cfg.is_excluded("model.layers.12.mlp.up_proj")
    assert cfg.is_excluded("model.layers.7.mlp.down_proj")
    assert cfg.is_excluded("model.layers.3.self_attn.q_proj")  # a module excludes its children
    assert not cfg.is_excluded("model.layers.30.self_attn.q_proj")
    assert not cfg.is_excluded("model.layers.0.mlp.gate_proj")


def test_excluded_modules_stay_unquantized(tiny_llama_dir, tmp_path, all_logits):
    out = quantize_nvfp4(tiny_llama_dir, tmp_path / "q", calib_ids(), exclude=["model.layers.0.mlp*"])
    q = WeightSource(out)
    assert q.get(f"{MLP}.down_proj.weight").dtype == torch.float32
    assert f"{MLP}.down_proj.weight_scale" not in q
    assert q.get("model.layers.1.mlp.down_proj.weight").dtype == torch.uint8
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["lm_head", "model.embed_tokens", "model.layers.0.mlp*"]
    model = load_model(out)
    assert isinstance(model.model.layers[0].mlp.down_proj.method, UnquantizedLinearMethod)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj.method, UnquantizedLinearMethod)
    assert isinstance(model.model.layers[1].mlp.down_proj.method, NVFP4LinearMethod)
    assert torch.isfinite(all_logits(model, calib_ids()[0])).all()


def test_excluding_part_of_a_fused_projection_is_an_error(tiny_llama_dir, tiny_nvfp4, tmp_path):
    with pytest.raises(ValueError, match="q_proj"):
        quantize_nvfp4(tiny_llama_dir, tmp_path / "q", calib_ids(), exclude=["*.q_proj"])
    bad = rewrite(tiny_nvfp4, tmp_path / "bad",
                  hf_quant=lambda c: c["quantization"]["exclude_modules"].append(f"{ATTN}.k_proj"),
                  config=lambda c: c["quantization_config"]["ignore"].append(f"{ATTN}.k_proj"))
    with pytest.raises(QuantConfigError, match=rf"{ATTN}\.k_proj \(excluded by"):
        load_model(bad)


# ---- fused projections --------------------------------------------------------------------

def test_fused_parts_with_different_scales_are_rescaled_to_the_max(tiny_llama_dir, tiny_nvfp4, tmp_path):
    """q/k/v quantized separately (own weight_scale_2, k's 20x smaller): the fused layer takes
    the max and rescales the other parts' block scales; codes are unchanged."""
    src = WeightSource(tiny_llama_dir)
    parts = {p: fp4.quantize_weight(src.get(f"{ATTN}.{p}_proj.weight") * (0.05 if p == "k" else 1.0))
             for p in "qkv"}

    def separate(t: dict) -> None:
        for p, qw in parts.items():
            t[f"{ATTN}.{p}_proj.weight"], t[f"{ATTN}.{p}_proj.weight_scale"] = qw.weight, qw.weight_scale
            t[f"{ATTN}.{p}_proj.weight_scale_2"] = qw.weight_scale_2
        t[f"{ATTN}.v_proj.input_scale"] = t[f"{ATTN}.q_proj.input_scale"] * 3

    layer = load_model(rewrite(tiny_nvfp4, tmp_path / "sep", separate)).model.layers[0].self_attn.qkv_proj
    target = max(qw.weight_scale_2 for qw in parts.values())
    assert layer.weight_scale_2 == target
    assert layer.input_scale == WeightSource(tiny_nvfp4).get(f"{ATTN}.q_proj.input_scale") * 3
    assert torch.equal(layer.weight, torch.cat([qw.weight for qw in parts.values()]))
    rows = 0
    for qw in parts.values():
        got = layer.weight_scale[rows:rows + qw.weight.shape[0]]
        want = fp4.to_e4m3(qw.weight_scale.float() * (qw.weight_scale_2 / target))
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        # the dequantized part moves by at most one E4M3 rounding of its block scales (2^-4)
        exact = fp4.dequantize(qw.weight, qw.weight_scale, qw.weight_scale_2)
        fused = fp4.dequantize(qw.weight, got, target)
        normal = (want.float() >= 2.0**-6).repeat_interleave(16, dim=-1)
        assert ((fused - exact).abs() <= exact.abs() / 16 + 1e-12)[normal].all()
        rows += qw.weight.shape[0]


def test_equal_part_scales_are_left_as_they_are():
    ws = fp4.to_e4m3(torch.rand(6, 4) * 400)
    out, s = unify_fused_scales(ws, [(0, 2), (2, 4)], torch.tensor([0.5, 0.5]))
    assert s == 0.5 and torch.equal(out.view(torch.uint8), ws.view(torch.uint8))


# ---- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("edit, message", [
    (lambda q: q.update(quant_algo="FP8"), "quant_algo 'FP8' is not supported"),
    (lambda q: q.update(quant_algo="MIXED_PRECISION"), "quant_algo 'MIXED_PRECISION'"),
    (lambda q: q.update(group_size=32), "group_size 32"),
    (lambda q: q.update(exclude_modules="lm_head"), "must be a list of strings"),
])
def test_unsupported_hf_quant_config_is_a_clear_error(edit, message):
    q = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    edit(q)
    with pytest.raises(QuantConfigError, match=message):
        parse_hf_quant_config({"quantization": q}, "x/hf_quant_config.json")


@pytest.mark.parametrize("edit, message", [
    (lambda q: q.update(quant_method="gptq"), "quant_method 'gptq' is not supported"),
    (lambda q: q.update(quant_method="compressed-tensors"), "quant_method 'compressed-tensors'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "not NVFP4"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=True), "dynamic"),
])
def test_unsupported_quantization_config_is_a_clear_error(edit, message):
    fp4_spec = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    q = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": [],
         "config_groups": {"group_0": {"weights": dict(fp4_spec), "input_activations": dict(fp4_spec)}}}
    edit(q)
    with pytest.raises(QuantConfigError, match=message):
        parse_quantization_config(q)


def test_config_forms_that_disagree_are_an_error(tiny_nvfp4, tmp_path):
    bad = rewrite(tiny_nvfp4, tmp_path / "bad", config=lambda c: c["quantization_config"]["ignore"].pop())
    with pytest.raises(QuantConfigError, match="hf_quant_config.json and .* quantization_config disagree"):
        load_model(bad)


def test_a_quantized_module_stored_unquantized_is_named(tiny_llama_dir, tmp_path):
    """The exclude list forgets a module that the checkpoint keeps in full precision."""
    out = quantize_nvfp4(tiny_llama_dir, tmp_path / "q", calib_ids(), exclude=[f"{MLP}.down_proj"])
    bad = rewrite(str(out), tmp_path / "bad",
                  hf_quant=lambda c: c["quantization"]["exclude_modules"].remove(f"{MLP}.down_proj"),
                  config=lambda c: c["quantization_config"]["ignore"].remove(f"{MLP}.down_proj"))
    with pytest.raises(QuantConfigError, match=rf"{MLP}\.down_proj\.weight is torch.float32"):
        load_model(bad)


@pytest.mark.parametrize("param", ["weight_scale", "weight_scale_2", "input_scale"])
def test_a_missing_tensor_of_a_fused_part_is_named(tiny_nvfp4, tmp_path, param):
    bad = rewrite(tiny_nvfp4, tmp_path / "bad", lambda t: t.pop(f"{ATTN}.k_proj.{param}"))
    with pytest.raises(QuantConfigError, match=rf"missing {ATTN}\.k_proj\.{param} "):
        load_model(bad)


def test_a_bad_scale_value_is_named(tiny_nvfp4, tmp_path):
    bad = rewrite(tiny_nvfp4, tmp_path / "bad",
                  lambda t: t.update({f"{MLP}.up_proj.input_scale": torch.tensor(0.0)}))
    with pytest.raises(QuantConfigError, match=rf"{MLP}\.up_proj\.input_scale = 0.0"):
        load_model(bad)


def test_quantized_tensors_without_a_config_are_named(tiny_nvfp4, tmp_path):
    bad = rewrite(tiny_nvfp4, tmp_path / "bad", hf_quant=lambda c: c.clear(),
                  config=lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.\S+ (is torch.uint8|has no place)"):
        load_model(bad)


# ---- the command line ---------------------------------------------------------------------

def test_cli_quantize_weights_only(tiny_llama_dir, tmp_path, all_logits):
    parser = argparse.ArgumentParser()
    add_quantize_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["quantize", "--nvfp4", tiny_llama_dir, str(tmp_path / "w4"), "--weights-only"])
    assert args.func(args) == 0
    cfg = detect(tmp_path / "w4")
    assert cfg.quant_algo == "W4A16_NVFP4" and not cfg.static_activations
    assert f"{ATTN}.q_proj.input_scale" not in WeightSource(tmp_path / "w4")
    assert torch.isfinite(all_logits(load_model(tmp_path / "w4"), calib_ids()[0])).all()
    with pytest.raises(QuantConfigError, match="W4A4 needs input_scale"):
        load_model(tmp_path / "w4", nvfp4_mode="w4a4")


# ---- an independent producer: NVIDIA ModelOpt ---------------------------------------------

@pytest.mark.timeout(300)
def test_modelopt_export_of_the_same_model_matches_ours(tiny_llama_dir, tiny_nvfp4, tmp_path, all_logits):
    """ModelOpt (CPU calibration, unified HF export) and `pdserve quantize` write the same bytes."""
    if importlib.util.find_spec("modelopt") is None:
        pytest.fail(f"NVIDIA ModelOpt not installed: `make test` installs it (pip install --no-deps {MODELOPT_PIP})")
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps(calib_ids()))
    script = Path(__file__).with_name("modelopt_export.py")
    run = subprocess.run([sys.executable, str(script), tiny_llama_dir, str(tmp_path / "mo"), str(calib)],
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs, ours = WeightSource(tmp_path / "mo"), WeightSource(tiny_nvfp4)
    assert detect(tmp_path / "mo").exclude == detect(tiny_nvfp4).exclude
    assert theirs.names() == ours.names()
    for name in ours.names():
        a, b = theirs.get(name), ours.get(name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name.endswith("input_scale"):  # amax of the same inputs through two fp32 models
            torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
        elif a.dtype == torch.float8_e4m3fn:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        else:
            assert torch.equal(a, b), name
    torch.testing.assert_close(logits(str(tmp_path / "mo"), all_logits), logits(tiny_nvfp4, all_logits),
                               rtol=1e-5, atol=1e-5)
