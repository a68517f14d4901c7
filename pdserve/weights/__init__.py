"""Model weights: safetensors directories, GGUF conversion, the default model.

Finding the model directory (`resolve_model_path`) needs no torch; the rest imports it, so it
is loaded on first use: `pdserve serve` finds the default model's cached conversion without
loading torch (~3 s of its start-up on a small machine)."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pdserve.weights.default_model import resolve_model_path

if TYPE_CHECKING:
    from pdserve.weights.gguf_convert import convert_gguf
    from pdserve.weights.safetensors_io import MissingWeightError, WeightSource, save_safetensors_dir

_LAZY = {"convert_gguf": "gguf_convert", "MissingWeightError": "safetensors_io",
         "WeightSource": "safetensors_io", "save_safetensors_dir": "safetensors_io"}

__all__ = [
    "MissingWeightError",
    "WeightSource",
    "convert_gguf",
    "resolve_model_path",
    "save_safetensors_dir",
]


def __getattr__(name: str) -> Any:
    """The torch-backed names, imported when first asked for (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(f"pdserve.weights.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
