"""DeepSeek-V3, DeepSeek-V3.2 and GLM-5 (MLA + MoE + DSA): pdserve's logits and greedy tokens
equal transformers' on tiny random models; absorbed paged decode equals a full recompute."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvcache import KVPool
from pdserve.layers.dsa import Indexer
from pdserve.models import load_model
from tests.tiny_models import DEEPSEEK_KINDS, make_deepseek


def random_ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(path: str, ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("kind", sorted(DEEPSEEK_KINDS))
@pytest.mark.parametrize("length", [12, 48])  # below and above index_topk (16)
def test_logits_match_transformers(deepseek_dir, all_logits, kind, length):
    path = deepseek_dir(kind)
    ids = random_ids(length)
    ref = reference_logits(path, ids)
    ours = all_logits(load_model(path), ids)
    assert (ours[-1] - ref[-1]).abs().max() < 1e-4
    assert (ours - ref).abs().max() < 1e-4


def test_sparsity_matters(deepseek_dir, all_logits, tmp_path):
    """The same weights with index_topk above the length (dense attention) give other logits:
    the parity above is not a dense model passing by accident."""
    ids = random_ids(48)
    sparse = all_logits(load_model(deepseek_dir("glm-5")), ids)
    dense_dir = make_deepseek(tmp_path, "glm-5", index_topk=1024)
    dense = all_logits(load_model(dense_dir), ids)
    assert torch.allclose(sparse[:16], dense[:16], atol=1e-5)  # the first 16 queries see everything
    assert (sparse[16:] - dense[16:]).abs().max() > 1e-2


def test_shared_indexer_layers_keep_no_index_keys(deepseek_dir):
    """GLM-5's "shared" layers reuse the top-k of the last "full" layer: the pool gives them the
    MLA latent only, so a model that shares its indexer needs fewer cache bytes per token."""
    shared = load_model(deepseek_dir("glm-5-shared"))  # pattern FSF
    full = load_model(deepseek_dir("glm-5"))
    names = [[s.name for s in layer] for layer in shared.cache_spec(torch.bfloat16)]
    assert names == [["latent", "index_k"], ["latent"], ["latent", "index_k"]]
    pool = KVPool(shared.cache_spec(torch.bfloat16), num_blocks=2, block_size=4)
    assert [sorted(layer) for layer in pool.layers] == [sorted(n) for n in names]
    index_bytes = 2 * shared.config.index_head_dim  # one bf16 key per token
    assert KVPool.bytes_per_token(full.cache_spec(torch.bfloat16)) - \
        KVPool.bytes_per_token(shared.cache_spec(torch.bfloat16)) == index_bytes


@pytest.mark.parametrize("kind", ["deepseek-v3", "glm-5-shared"])
def test_absorbed_decode_equals_full_recompute(deepseek_dir, all_logits, kind):
    """Token by token (absorbed MLA on cached latents, one query per step) and in chunks of 5
    (expanded MLA over cached latents) equal one pass over the whole sequence, and transformers."""
    path = deepseek_dir(kind)
    model = load_model(path)
    ids = random_ids(40, seed=3)
    whole = all_logits(model, ids)
    for chunk in (1, 5):
        assert (all_logits(model, ids, chunk=chunk) - whole).abs().max() < 1e-5
    # and transformers' recompute of the whole sequence at once, no cache involved
    assert (all_logits(model, ids, chunk=1) - reference_logits(path, ids)).abs().max() < 1e-4


def engine_greedy(path: str, prompts: list[list[int]], n: int, index_dtype: str) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=path, index_cache_dtype=index_dtype, block_size=8))
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out = {f"r{i}": [] for i in range(len(prompts))}
    for o in engine.run_until_done():
        if o.token_id is not None:
            out[o.request_id].append(o.token_id)
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("kind", ["deepseek-v3.2", "glm-5"])
def test_greedy_continuations_equal_transformers(deepseek_dir, kind):
    """32 greedy tokens from the engine (batched, paged, absorbed decode) equal transformers'
    generate; a difference is allowed only after a top-2 logit margin below 1e-3 (none seen)."""
    path = deepseek_dir(kind)
    prompts = [random_ids(n, seed=n) for n in (5, 12, 30)]
    ours = engine_greedy(path, prompts, 32, "float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        if got != ref:
            i = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
            with torch.no_grad():
                top = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1].topk(2).values
            assert float(top[0] - top[1]) < 1e-3, (prompt, got, ref)


def topk_masks(model: torch.nn.Module) -> tuple[list[torch.Tensor], list]:
    """Record every indexer's masks (one list entry per layer call) with forward hooks."""
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.extend(out))
             for m in model.modules() if isinstance(m, Indexer)]
    return seen, hooks


def test_index_key_dtypes_against_fp32(deepseek_dir, all_logits, tmp_path, record_property):
    """bf16 (the default) and fp8 index keys against fp32 keys on a long random sequence:
    the share of fp32's top-k tokens each keeps, and the logit difference it causes."""
    path = make_deepseek(tmp_path, "glm-5", index_topk=64)
    model = load_model(path)
    ids = random_ids(512, seed=7)
    report = {}
    runs = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16),
                        ("fp8", torch.float8_e4m3fn)):
        seen, hooks = topk_masks(model)
        logits = all_logits(model, ids, block_size=16, index_dtype=dtype)
        for h in hooks:
            h.remove()
        runs[name] = (torch.stack([m[64:] for m in seen]), logits)  # queries that must choose
    ref_masks, ref_logits = runs["float32"]
    for name in ("bfloat16", "fp8"):
        masks, logits = runs[name]
        overlap = float((masks & ref_masks).sum() / ref_masks.sum())
        report[name] = {"topk_overlap": round(overlap, 5),
                        "max_logit_diff": float((logits - ref_logits).abs().max()),
                        "mean_logit_diff": float((logits - ref_logits).abs().mean())}
    record_property("index_key_dtypes", json.dumps(report))
    print("index keys vs fp32 (512 tokens, top-64):", json.dumps(report))
    assert report["bfloat16"]["topk_overlap"] > report["fp8"]["topk_overlap"]
    assert report["bfloat16"]["topk_overlap"] > 0.97
    assert report["bfloat16"]["mean_logit_diff"] < report["fp8"]["mean_logit_diff"]


def test_checkpoint_mtp_layers_are_skipped(deepseek_dir, all_logits, tmp_path, caplog):
    """A checkpoint with a multi-token-prediction layer after the last one (as the published
    DeepSeek-V3 and GLM-5 checkpoints have) loads, skips it with a log line, and computes the same."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = deepseek_dir("glm-5")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    tensors = load_file(f"{src}/model.safetensors")
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    mtp["model.layers.3.shared_head.head.weight"] = torch.zeros(256, 64)
    save_file({**tensors, **mtp}, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    ids = random_ids(30)
    with caplog.at_level("INFO", logger="pdserve.models.deepseek"):
        ours = all_logits(load_model(str(tmp_path)), ids)
    assert "multi-token-prediction layers [3]" in caplog.text
    assert torch.equal(ours, all_logits(load_model(src), ids))
