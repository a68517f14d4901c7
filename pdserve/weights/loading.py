"""Checkpoint loading shared by the models: tensor name → (module, parameter, shard id) →
`module.load(...)`, which reads only this rank's slice."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from torch import nn

logger = logging.getLogger(__name__)

Target = Callable[[str], tuple[str, str, object]]


def stacked_target(name: str, stacked: dict[str, tuple[str, object]]) -> tuple[str, str, object]:
    """(module, parameter, shard id) of checkpoint tensor `name`, where a module named in
    `stacked` (e.g. "q_proj") is one part of a fused module (e.g. ("qkv_proj", "q"))."""
    module_name, _, param = name.rpartition(".")
    parent, _, leaf = module_name.rpartition(".")
    if leaf in stacked:
        leaf, shard_id = stacked[leaf]
        return f"{parent}.{leaf}", param, shard_id
    return module_name, param, None


def load_tensors(model: nn.Module, source, names: Iterable[str], target: Target,
                 strict: bool = True) -> set[str]:
    """Load every tensor of `names` into the parameter `target(name)` says; returns the
    parameters loaded (names within `model`). A tensor whose module does not exist raises
    (`strict`) or is logged and skipped; one whose module lacks the parameter always raises
    (usually a quantization config that does not match the checkpoint)."""
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for name in names:
        module_name, param, shard_id = target(name)
        module = modules.get(module_name)
        if module is None and not strict:
            logger.warning("checkpoint tensor %s has no place in the model; skipped", name)
            continue
        if module is None or not hasattr(module, param):
            raise ValueError(f"checkpoint tensor {name} has no place in {module_name or 'the model'}; "
                             "do config.json and the quantization config (or its exclude list) "
                             "match the checkpoint?")
        module.load(param, source, name, shard_id)
        loaded.add(f"{module_name}.{param}")
    return loaded


def require_loaded(model: nn.Module, loaded: set[str], what: str = "the model") -> None:
    """Raise when a parameter of `model` got no checkpoint tensor."""
    missing = sorted({n for n, _ in model.named_parameters()} - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing tensors for {what}: {missing[:8]}")
