"""The MoE block equals transformers' DeepseekV3MoE / GlmMoeDsaMoE / DeepseekV32MoE on the same
checkpoint tensors (as save_pretrained writes them), on one rank and on two real gloo ranks."""
from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path

import pytest
import torch

from pdserve.distributed import TPGroup
from pdserve.layers.moe import MoE
from pdserve.layers.quant import UnquantizedLinearMethod, finish_loading
from pdserve.layers.quant.nvfp4 import NVFP4LinearMethod
from pdserve.weights import WeightSource, save_safetensors_dir

PREFIX = "model.layers.1.mlp"  # layer 0 is dense (first_k_dense_replace=1), layer 1 the MoE
TOKENS = 40
CASES = {  # name → (config class, n_group, topk_group, n_shared_experts, norm_topk_prob)
    "deepseek_v3-grouped": ("DeepseekV3Config", 4, 2, 1, True),
    "glm_moe_dsa-ungrouped": ("GlmMoeDsaConfig", 1, 1, 2, False),
    "deepseek_v32-grouped": ("DeepseekV32Config", 4, 2, 2, False),
}


def hf_config(case: str):
    import transformers

    cls, n_group, topk_group, n_shared, norm = CASES[case]
    return getattr(transformers, cls)(
        vocab_size=32, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=n_group, topk_group=topk_group, n_shared_experts=n_shared, norm_topk_prob=norm,
        routed_scaling_factor=2.5, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)


def reference(case: str, path: Path, skewed: bool = False, seed: int = 0) -> torch.nn.Module:
    """A tiny random transformers model saved to `path`; returns its MoE block.

    Random weights at a scale where routing is decided by the scores, and a nonzero
    e_score_correction_bias (transformers initialises it to zero) so that choosing on biased
    scores but weighting by unbiased ones is exercised. `skewed`: a bias so large that every
    token picks experts 0 and 1, and experts 2..7 get nothing.
    """
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(case), dtype=torch.float32)
    moe = model.model.layers[1].mlp
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.1)
        moe.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
        if skewed:
            moe.gate.e_score_correction_bias[:2] += 10.0
        moe.experts.gate_up_proj.normal_(0, 0.1)
        moe.experts.down_proj.normal_(0, 0.1)
    model.save_pretrained(path)
    return moe


def moe_names(source: WeightSource) -> list[str]:
    return [n for n in source.names() if n.startswith(PREFIX + ".")]


def build(case: str, tp: TPGroup = TPGroup(), quant=None) -> MoE:
    _, n_group, topk_group, n_shared, norm = CASES[case]
    return MoE(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
               n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5,
               n_shared_experts=n_shared, prefix=PREFIX, tp=tp, quant=quant)


def load(case: str, path: Path, tp: TPGroup = TPGroup(), quant=None) -> MoE:
    source = WeightSource(path)
    moe = build(case, tp, quant)
    moe.load_weights(source, moe_names(source))
    finish_loading(moe, torch.float32)
    return moe


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randn(TOKENS, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_moe_equals_transformers_fp32(case, tmp_path):
    ref = reference(case, tmp_path)
    moe = load(case, tmp_path)
    x = tokens()
    with torch.no_grad():
        expected = ref(x)
        got = moe(x)
        ref_ids = ref.gate(x)[2]  # (logits, weights, ids)
        weights, ids = moe.gate(x)
        bias = moe.gate.e_score_correction_bias.data.clone()
        moe.gate.e_score_correction_bias.data.zero_()
        _, unbiased_ids = moe.gate(x)
    assert torch.equal(ids.sort(dim=1).values, ref_ids.sort(dim=1).values)
    assert not torch.equal(ids.sort(dim=1).values, unbiased_ids.sort(dim=1).values)  # bias matters
    assert bias.abs().max() > 0 and weights.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_router_weights_are_unbiased_normalised_and_scaled(tmp_path):
    ref = reference("deepseek_v3-grouped", tmp_path)
    moe = load("deepseek_v3-grouped", tmp_path)
    x = tokens()
    with torch.no_grad():
        weights, ids = moe.gate(x)
        scores = (x @ ref.gate.weight.T).sigmoid()
    picked = scores.gather(1, ids)
    torch.testing.assert_close(weights, 2.5 * picked / picked.sum(dim=1, keepdim=True))
    torch.testing.assert_close(weights.sum(dim=1), torch.full((TOKENS,), 2.5))
    # group-limited: each token's experts lie in at most topk_group=2 of the 4 groups of 2
    assert all(len(set(row)) <= 2 for row in (ids // 2).tolist())


def test_idle_experts_and_one_expert_taking_every_token(tmp_path):
    ref = reference("deepseek_v3-grouped", tmp_path, skewed=True)
    moe = load("deepseek_v3-grouped", tmp_path)
    x = tokens()
    with torch.no_grad():
        _, ids = moe.gate(x)
        expected, got = ref(x), moe(x)
    assert torch.equal(ids.sort(dim=1).values, torch.tensor([[0, 1]] * TOKENS))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert moe(x[:0]).shape == (0, 64)  # no tokens at all: no expert runs


def test_bf16_keeps_the_router_fp32_and_equals_transformers(tmp_path):
    """transformers keeps the gate's weight and bias fp32 in a bf16 model and sums the routed
    contributions in fp32 before one rounding (its default grouped_mm experts path)."""
    import transformers

    from pdserve.models.registry import default_dtype

    reference("glm_moe_dsa-ungrouped", tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ref = hf.model.layers[1].mlp
    assert ref.gate.weight.dtype == torch.float32 and ref.experts.gate_up_proj.dtype == torch.bfloat16
    source = WeightSource(tmp_path)
    with default_dtype(torch.bfloat16):
        moe = build("glm_moe_dsa-ungrouped")
    moe.load_weights(source, moe_names(source))
    finish_loading(moe, torch.bfloat16)
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts["0"].gate_up_proj.weight.dtype == torch.bfloat16
    x = tokens().to(torch.bfloat16)
    with torch.no_grad():
        expected, got = ref(x), moe(x)
        assert torch.equal(moe.gate(x)[1].sort(dim=1).values, ref.gate(x)[2].sort(dim=1).values)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_nvfp4_experts_load_and_the_excluded_gate_stays_fp32(tmp_path):
    """A ModelOpt-style checkpoint: routed experts NVFP4 (gate/up sharing one weight_scale_2),
    the router gate and the shared experts excluded, as real GLM-5 NVFP4 checkpoints do."""
    import pdserve_kernels.nvfp4 as fp4
    from pdserve.weights.nvfp4 import NVFP4Config, quantize_with_scale_2, weight_scale_2_from_amax

    ref = reference("deepseek_v3-grouped", tmp_path / "bf")
    tensors = dict(WeightSource(tmp_path / "bf"))
    for e in range(8):
        gate_up, down = ref.experts.gate_up_proj[e].detach(), ref.experts.down_proj[e].detach()
        parts = {"gate_proj": gate_up[:32], "up_proj": gate_up[32:], "down_proj": down}
        fused_scale = weight_scale_2_from_amax(gate_up.abs().max())  # one tensor scale for gate+up
        for proj, w in parts.items():
            q = quantize_with_scale_2(w, fused_scale if proj != "down_proj" else
                                      weight_scale_2_from_amax(w.abs().max()))
            name = f"{PREFIX}.experts.{e}.{proj}"
            tensors |= {f"{name}.weight": q.weight, f"{name}.weight_scale": q.weight_scale,
                        f"{name}.weight_scale_2": q.weight_scale_2.reshape(()).clone(),
                        f"{name}.input_scale": fp4.input_scale_from_amax(4.0)}
            with torch.no_grad():  # the reference computes with the dequantized values
                w.copy_(fp4.dequantize(q.weight, q.weight_scale, q.weight_scale_2))
    save_safetensors_dir(tensors, tmp_path / "fp4")
    quant = NVFP4Config("NVFP4", ("lm_head", "model.layers.*.mlp.gate", "model.layers.*.mlp.shared_experts*"),
                        None, "test", mode="w4a16")
    moe = load("deepseek_v3-grouped", tmp_path / "fp4", quant=quant)
    assert isinstance(moe.experts["5"].gate_up_proj.method, NVFP4LinearMethod)
    assert isinstance(moe.experts["5"].down_proj.method, NVFP4LinearMethod)
    assert isinstance(moe.shared_experts.gate_up_proj.method, UnquantizedLinearMethod)
    assert moe.gate.weight.dtype == torch.float32
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(moe(x), ref(x), atol=1e-5, rtol=1e-5)


def test_uneven_expert_split_is_refused():
    with pytest.raises(ValueError, match="do not split evenly over TP size 3"):
        build("deepseek_v3-grouped", TPGroup(rank=0, size=3))


def test_loading_refuses_missing_unknown_and_quantized_router_tensors(tmp_path):
    reference("deepseek_v3-grouped", tmp_path)
    source = WeightSource(tmp_path)
    names = moe_names(source)
    with pytest.raises(ValueError, match="missing tensors .*experts.3.down_proj.weight"):
        build("deepseek_v3-grouped").load_weights(source, [n for n in names if ".experts.3.down" not in n])
    tensors = dict(source)
    tensors[f"{PREFIX}.experts.8.up_proj.weight"] = tensors[f"{PREFIX}.experts.0.up_proj.weight"].clone()
    tensors[f"{PREFIX}.gate.weight"] = tensors[f"{PREFIX}.gate.weight"].to(torch.uint8)
    save_safetensors_dir(tensors, tmp_path / "bad")
    bad = WeightSource(tmp_path / "bad")
    with pytest.raises(ValueError, match="expert 8 of 8 routed experts"):
        build("deepseek_v3-grouped").load_weights(bad, [f"{PREFIX}.experts.8.up_proj.weight"])
    with pytest.raises(ValueError, match="router expects an unquantized float"):
        build("deepseek_v3-grouped").load_weights(bad, [f"{PREFIX}.gate.weight"])


class RecordingSource(WeightSource):
    """A WeightSource that remembers which tensors were read."""

    def __init__(self, model_dir: Path):
        super().__init__(model_dir)
        self.read: set[str] = set()

    def get(self, name: str, dtype=None) -> torch.Tensor:
        self.read.add(name)
        return super().get(name, dtype)

    def get_slice(self, name: str, dim: int, start: int, stop: int, dtype=None) -> torch.Tensor:
        self.read.add(name)
        return super().get_slice(name, dim, start, stop, dtype)


def rank_main(rank: int, port: int, dirs: dict[str, str], x: torch.Tensor, results) -> None:
    torch.set_num_threads(1)
    from pdserve.distributed.groups import close_tp, init_tp

    tp, _ = init_tp(rank, 2, port, timeout_s=60)
    out = {}
    for label, path in dirs.items():
        source = RecordingSource(Path(path))
        moe = build("deepseek_v3-grouped", tp)
        moe.load_weights(source, moe_names(source))
        finish_loading(moe, torch.float32)
        with torch.no_grad():
            y = moe(x)
        experts_read = sorted({int(n.split(".")[5]) for n in source.read if ".experts." in n})
        out[label] = (y.numpy(), sorted(moe.experts), experts_read, len(list(moe.parameters())),
                      tuple(moe.shared_experts.gate_up_proj.weight.shape))
    results.put((rank, out))
    close_tp()


def test_two_ranks_equal_one(tmp_path):
    dirs = {"random": tmp_path / "random", "skewed": tmp_path / "skewed"}
    refs = {"random": reference("deepseek_v3-grouped", dirs["random"]),
            "skewed": reference("deepseek_v3-grouped", dirs["skewed"], skewed=True)}
    x = tokens()
    with torch.no_grad():
        single = {label: load("deepseek_v3-grouped", path)(x) for label, path in dirs.items()}
        for label, ref in refs.items():
            torch.testing.assert_close(single[label], ref(x), atol=1e-5, rtol=1e-5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, {k: str(v) for k, v in dirs.items()}, x, results))
             for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank, owned in ((0, ["0", "1", "2", "3"]), (1, ["4", "5", "6", "7"])):
        for label in dirs:
            y, experts, read, n_params, shared_shape = got[rank][label]
            assert experts == owned and read == [int(e) for e in owned]  # only its own experts read
            assert n_params == 2 + 4 * 2 + 2      # router (2), 4 experts and the shared (2 each)
            assert shared_shape == (32, 64)       # shared gate_up [2 × 32, 64] split over 2 ranks
            torch.testing.assert_close(torch.from_numpy(y), single[label], atol=1e-5, rtol=1e-5)
