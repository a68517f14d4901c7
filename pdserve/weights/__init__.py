"""Model weights: safetensors directories, GGUF conversion, the default model."""
from __future__ import annotations

from pdserve.weights.default_model import resolve_model_path
from pdserve.weights.gguf_convert import convert_gguf
from pdserve.weights.safetensors_io import MissingWeightError, WeightSource, save_safetensors_dir

__all__ = [
    "MissingWeightError",
    "WeightSource",
    "convert_gguf",
    "resolve_model_path",
    "save_safetensors_dir",
]
