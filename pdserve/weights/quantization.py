"""Which quantization a model runs with (`--quantization`), and where its weights come from.

* `none`: the checkpoint as it is (fp32/bf16, or a ModelOpt NVFP4 checkpoint, detected).
* `gguf`: a model converted from a GGUF keeps the GGUF's Q4_0/Q4_1/Q8_0 blocks (its `gguf/`
  folder, written by pdserve.weights.gguf_convert): linears, embeddings and the LM head run on
  the blocks, never dequantized as a whole.
* `int8` / `int4`: a float checkpoint quantized on load, per group of 32 weights along the input
  (one fp16 scale a group; int4 also one fp16 minimum): the GGUF formats Q8_0 / Q4_1, so the
  same kernels run them. The embeddings and LM head take Q8_0 in both cases (a 4-bit head
  costs the most accuracy and is a small part of a step's bytes).
* `auto`: `gguf` on a CPU when the model directory has the blocks, else `none`. The command
  line defaults to `auto`; `EngineConfig` and `load_model` default to `none`, so code that asks
  for a model directory gets exactly its weights (the transformers equality tests use fp32).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from pdserve.layers.quant import LinearMethod, QuantConfigError
from pdserve.layers.quant.blocks import BlockQuantLinearMethod
from pdserve.weights.gguf_convert import BLOCKS_CONFIG, BLOCKS_DIR
from pdserve_kernels.quant import Q4_1, Q8_0, BlockFormat, block_format

logger = logging.getLogger(__name__)

CHOICES = ("auto", "none", "gguf", "int8", "int4")
ON_LOAD = {"int8": Q8_0, "int4": Q4_1}
EMBEDDINGS_ON_LOAD = Q8_0
EMBEDDING_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class BlockQuantConfig:
    """Layers in GGUF blocks: the formats a GGUF gave each tensor, or one format applied on load."""

    quant_algo: str                                   # GGUF | INT8 | INT4, for the load log
    source: str                                       # where the config came from, for messages
    formats: Mapping[str, BlockFormat] = field(default_factory=dict)  # tensor -> format (GGUF)
    on_load: BlockFormat | None = None                # linears quantized on load to this format

    def linear_method(self, names: list[str]) -> LinearMethod | None:
        """The method of the linear made of checkpoint modules `names` (fused when several)."""
        if self.on_load is not None:
            return BlockQuantLinearMethod(self.on_load, on_load=True, name=names[0])
        found = [self.formats.get(f"{n}.weight") for n in names]
        if all(f is None for f in found):
            return None  # stored as float in the checkpoint (an F32/F16/K-quant GGUF tensor)
        if len(set(found)) > 1:
            parts = ", ".join(f"{n} ({f.name if f else 'float'})" for n, f in zip(names, found, strict=True))
            raise QuantConfigError(f"{self.source}: pdserve runs {', '.join(names)} as one fused matmul, "
                                   f"so they must share one block format: {parts}. Load this model "
                                   "with --quantization none")
        return BlockQuantLinearMethod(found[0], on_load=False, name=names[0])

    def embedding_format(self, name: str) -> tuple[BlockFormat, bool] | None:
        """(format, quantize on load) of the embedding or LM head tensor `name`; None: float."""
        if self.on_load is not None:
            return (EMBEDDINGS_ON_LOAD, True) if name in EMBEDDING_TENSORS else None
        fmt = self.formats.get(name)
        return None if fmt is None else (fmt, False)

    def ignores_tensor(self, name: str) -> bool:
        return False


class Selected(NamedTuple):
    """The quantization config a model is built with (None: plain) and its weights' folder."""

    quant: object | None
    weights_dir: Path


def select(model_dir: str | Path, hf_config: dict, quantization: str = "none", device: str = "cpu",
           nvfp4_mode: str = "auto") -> Selected:
    """The config and weights folder for `--quantization` (see the module docstring)."""
    from pdserve.weights.nvfp4 import detect

    if quantization not in CHOICES:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(CHOICES)}")
    model_dir = Path(model_dir)
    blocks = model_dir / BLOCKS_DIR
    if quantization == "auto":
        quantization = "gguf" if (blocks / BLOCKS_CONFIG).is_file() and device == "cpu" else "none"
    if quantization == "gguf":
        return Selected(read_blocks_config(blocks), blocks)
    nvfp4 = detect(model_dir, hf_config, nvfp4_mode)
    if quantization == "none":
        return Selected(nvfp4, model_dir)
    if nvfp4 is not None:
        raise QuantConfigError(f"{model_dir} is an NVFP4 checkpoint already; --quantization "
                               f"{quantization} quantizes float checkpoints")
    fmt = ON_LOAD[quantization]
    return Selected(BlockQuantConfig(quantization.upper(), f"--quantization {quantization} ({fmt.name}, "
                                     "groups of 32)", on_load=fmt), model_dir)


def read_blocks_config(blocks_dir: Path) -> BlockQuantConfig:
    """The formats of a converted GGUF's `gguf/` folder."""
    path = blocks_dir / BLOCKS_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"--quantization gguf: {path} not found; the model directory was not "
                                "converted from a GGUF by this pdserve (pass the .gguf file itself, "
                                "or delete the cached conversion so it is redone)")
    data = json.loads(path.read_text())
    formats = {name: block_format(fmt) for name, fmt in data["tensors"].items()}
    return BlockQuantConfig("GGUF", f"{path} ({data.get('source', '?')})", formats)
