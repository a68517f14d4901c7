"""--kv-cache-dtype float16 (docs/kv-cache-dtype.md): the pool holds half the bytes, the logits
move only by the rounding of K and V, a PD peer with the other dtype is refused by the layout
check, and the option is refused where it cannot run.

Cache on = off with an fp16 cache: tests/engine/test_prefix_cache.py; the kernels over fp16
caches against the torch reference: tests/kernels/."""
from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.transfer.layout import LayoutMismatch, PoolLayout


def _engine(model_dir: str, kv: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, kv_cache_memory=1 << 20, dtype="float32", kv_cache_dtype=kv))


def test_an_fp16_pool_holds_twice_the_blocks_and_names_them_apart(tiny_llama_dir):
    fp32, fp16 = _engine(tiny_llama_dir, "auto"), _engine(tiny_llama_dir, "float16")
    assert {t.dtype for t in fp16.pool.tensors()} == {torch.float16}
    assert {t.dtype for t in fp32.pool.tensors()} == {torch.float32}
    assert fp16.pool.num_blocks == 2 * fp32.pool.num_blocks  # the same 1 MiB
    # a block's name says what its KV was stored as: the two never share a cached block
    assert fp16.scheduler.config.cache_salt != fp32.scheduler.config.cache_salt
    with pytest.raises(LayoutMismatch, match="bytes per block"):
        PoolLayout.of(fp32.pool.tensors()).check_compatible(PoolLayout.of(fp16.pool.tensors()), "decode worker")


def test_the_option_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="is for CPU workers"):
        EngineConfig(device="cuda", kv_cache_dtype="float16").kv_torch_dtype()
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8").kv_torch_dtype()
    assert EngineConfig(device="cuda").kv_torch_dtype() == torch.bfloat16  # auto: the compute dtype
    assert EngineConfig(kv_cache_dtype="float16").kv_torch_dtype() == torch.float16


def test_logits_over_an_fp16_cache_stay_within_its_rounding_of_transformers(default_model_dir, all_logits):
    """The default model with fp32 weights (quantization none: transformers' own weights), the
    prompt in chunks of 5 so every chunk attends over K/V read back from the fp16 cache. fp16
    keeps 11 significant bits (relative rounding ≤ 2^-11 ≈ 4.9e-4 per K/V element); over this
    model's 30 layers that moved the logits (magnitudes ≈ 10–30) by ≤ 9.3e-3 here, against ≤ 7e-5
    with an fp32 cache: bound 3e-2. Every greedy choice whose margin in the reference is above
    that bound is the reference's."""
    engine = LLMEngine(EngineConfig(model=default_model_dir, quantization="none", kv_cache_memory=1 << 24,
                                    kv_cache_dtype="float16"))
    from pdserve.tokenizer import Tokenizer

    ids = Tokenizer(default_model_dir).encode(
        "The history of the Roman empire is long and full of wars, emperors, senators and the people "
        "of Rome, who")
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    fp16 = all_logits(engine.model, ids, chunk=5, block_size=16, cache_dtype=torch.float16)
    fp32 = all_logits(engine.model, ids, chunk=5, block_size=16)
    assert float((fp32 - ref).abs().max()) < 1e-4
    err = float((fp16 - ref).abs().max())
    assert 1e-4 < err < 3e-2, err  # fp16's rounding shows, and stays within its bound
    top = ref.topk(2, dim=-1).values
    clear = (top[:, 0] - top[:, 1]) > 3e-2
    assert torch.equal(fp16.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_a_model_whose_cache_is_not_k_and_v_refuses_fp16(tmp_path):
    from tests.tiny_models import make_deepseek

    path = make_deepseek(tmp_path, "deepseek-v3")
    with pytest.raises(ValueError, match="cache is K and V"):
        LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_memory=1 << 20, kv_cache_dtype="float16"))


def test_the_flag_reaches_the_workers_engine_config():
    from pdserve.cli import build_parser, engine_config
    from pdserve.launcher import engine_flags

    assert engine_config(build_parser().parse_args(["generate", "hi"])).kv_cache_dtype == "auto"
    flags = engine_flags(build_parser().parse_args(["serve", "--kv-cache-dtype", "float16"]))
    worker = build_parser().parse_args(["worker", "--role", "both", *flags])
    assert engine_config(worker).kv_cache_dtype == "float16"
    assert "--kv-cache-dtype" not in engine_flags(build_parser().parse_args(["serve"]))
