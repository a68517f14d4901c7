"""The name a model is served under: what clients put in "model", and the `model_name` label
of every metric. The router and the workers derive it from the same flags (--model,
--served-model-name) with this one function, so their series carry the same label."""
from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("", "default")


def served_name(model: str | None, explicit: str | None = None) -> tuple[str, tuple[str, ...]]:
    """(name, aliases) for a ``--model`` value: the default model is SmolLM2-135M-Instruct."""
    if explicit:
        return explicit, tuple(a for a in (model,) if a and a != explicit)
    if model is None or model in DEFAULT_MODEL_ALIASES:
        return DEFAULT_MODEL_NAME, ("default",)
    return model, (Path(model).name,) if Path(model).name != model else ()
