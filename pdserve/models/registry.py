"""config.json `architectures` → model class, and model construction + weight loading."""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from pdserve.distributed import TPGroup

from .deepseek import DeepseekForCausalLM
from .llama import LlamaForCausalLM
from .scripted import ScriptedForCausalLM

logger = logging.getLogger(__name__)

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekForCausalLM,
    "GlmMoeDsaForCausalLM": DeepseekForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "ScriptedForCausalLM": ScriptedForCausalLM,
}


def model_class(hf_config: dict) -> type[nn.Module]:
    for arch in hf_config.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(f"unsupported architecture {hf_config.get('architectures')}; "
                     f"pdserve supports {sorted(ARCHITECTURES)}")


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def eos_token_ids(model_dir: str | Path) -> frozenset[int]:
    """Token ids that end generation: config.json's and generation_config.json's eos_token_id."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               tp: TPGroup = TPGroup(), nvfp4_mode: str = "auto", quantization: str = "none") -> nn.Module:
    """Build the model of `model_dir/config.json` and load its weights (this rank's slices only).

    A ModelOpt NVFP4 checkpoint is detected from its config; `nvfp4_mode` (auto | w4a16 | w4a4)
    says how its layers compute (pdserve.layers.quant.nvfp4). `quantization` (none | auto | gguf |
    int8 | int4) keeps a converted GGUF's blocks or quantizes on load (pdserve.weights.quantization).
    """
    from pdserve.layers.embedding import finish_heads, use_block_formats
    from pdserve.layers.quant import finish_loading
    from pdserve.weights import WeightSource
    from pdserve.weights.quantization import select

    hf_config = read_config(model_dir)
    cls = model_class(hf_config)
    quant, weights_dir = select(model_dir, hf_config, quantization, torch.device(device).type, nvfp4_mode)
    # built in `dtype` rather than cast afterwards: a cast would also convert the float8 and
    # fp32 scales of quantized layers
    with torch.device(device), default_dtype(dtype):
        model = cls(hf_config, tp, quant)
        use_block_formats(model, quant)
    if getattr(model, "has_weights", True):
        model.load_weights(WeightSource(weights_dir))
    finish_loading(model, dtype)
    finish_heads(model)
    model.eval()
    packed = sum(getattr(m, "packed", None) is not None for m in model.modules())
    logger.info("loaded %s from %s (%s, %s, tp %d/%d%s%s)", cls.__name__, model_dir, dtype, device,
                tp.rank, tp.size, f", {quant.quant_algo} from {quant.source}" if quant else "",
                f", int16 activations in {packed} layers" if packed else "")
    return model


def multiplies_natively(model: nn.Module) -> bool:
    """Whether every matrix product of `model`'s forward runs in the native CPU kernels: every
    linear layer and LM head holds its matrix in GGUF blocks (packed for the int16 kernel or
    not) and the block matmuls are bound to their native variants; an embedding table is a
    lookup. Then torch's own CPU ops in a step are all small (docs/cpu-threads.md)."""
    import pdserve_kernels as ops
    from pdserve.layers.embedding import Embedding, LMHead
    from pdserve.layers.quant.blocks import BlockQuantLinearMethod

    if not ops.is_native(ops.qmatmul):
        return False
    for module in model.modules():
        if isinstance(module, LMHead):
            if module.block_format() is None:
                return False  # a float head: torch's GEMM
        elif not isinstance(module, Embedding) and any(p.dim() >= 2 for p in module.parameters(recurse=False)):
            if not isinstance(getattr(module, "method", None), BlockQuantLinearMethod):
                return False  # a float or NVFP4 linear, experts, ...: torch multiplies
    return True


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Floating tensors created without an explicit dtype get `dtype` inside the block."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)
