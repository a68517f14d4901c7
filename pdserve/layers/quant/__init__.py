"""How a linear layer stores its weight and multiplies by it: plain, NVFP4, or GGUF blocks.

A `LinearMethod` is chosen per layer when the model is built (from the checkpoint's quantization
config and exclude list) and owns the layer's weight parameters: it creates them, loads the
layer's slice of each checkpoint tensor, prepares them once after loading (`finish`), and runs
the matmul (`apply`). The linear classes only say which slice of a checkpoint tensor a rank
reads (a `Shard`), so sharding and quantization stay independent.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class QuantConfigError(ValueError):
    """A checkpoint's quantization config, or a tensor of it, is unsupported or inconsistent."""


class Shard(NamedTuple):
    """The part of a checkpoint tensor one rank reads, and where it goes in the layer."""

    dim: int     # the sliced checkpoint dimension: 0 output rows, 1 input columns
    start: int   # [start, stop) along `dim`, counted in weight elements (before packing)
    stop: int
    offset: int  # first output row of the layer's parameter that receives the slice
    part: int    # index of the fused part (q, k, v or gate, up); 0 for a plain layer


class QuantConfig(Protocol):
    """What the model asks of a checkpoint's quantization config (pdserve.weights.nvfp4 and
    pdserve.weights.quantization)."""

    def linear_method(self, names: list[str]) -> LinearMethod | None:
        """The method for the linear made of checkpoint modules `names`; None: not quantized."""

    def ignores_tensor(self, name: str) -> bool:
        """Checkpoint tensors the model reads past (e.g. KV-cache scales it does not use)."""


class LinearMethod(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        """Register the layer's weight parameters (this rank's shape)."""

    @abstractmethod
    def load(self, layer: nn.Module, param: str, source, name: str, shard: Shard) -> None:
        """Copy this rank's slice of checkpoint tensor `name` into parameter `param`."""

    def finish(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """Called once after every tensor is loaded (`dtype`: the model's): check and prepare."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x W^T (+ bias), in x's dtype."""


class UnquantizedLinearMethod(LinearMethod):
    """A dense weight in the model's dtype."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def load(self, layer: nn.Module, param: str, source, name: str, shard: Shard) -> None:
        if param != "weight":
            raise ValueError(f"checkpoint tensor {name}: quantization data for a layer that is not "
                             "quantized (missing quantization config, or the module is excluded)")
        tensor = read_shard(source, name, shard)
        if not tensor.is_floating_point():
            raise ValueError(f"checkpoint tensor {name} is {tensor.dtype}, a quantized weight, but "
                             "the layer is not quantized (missing quantization config, or the "
                             "module matches an exclude/ignore pattern)")
        place(layer.weight, tensor, shard, name)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


def linear_method(quant: QuantConfig | None, names: list[str]) -> LinearMethod:
    """The method for a linear layer made of the checkpoint modules `names` (fused if several)."""
    method = quant.linear_method(names) if quant is not None else None
    return method or UnquantizedLinearMethod()


def read_shard(source, name: str, shard: Shard, per_element: int = 1) -> torch.Tensor:
    """This rank's slice of `name`; along dim 1 `per_element` columns hold one stored value."""
    if shard.dim == 0:
        return source.get_slice(name, 0, shard.start, shard.stop)
    if shard.start % per_element or shard.stop % per_element:
        raise ValueError(f"checkpoint tensor {name}: input slice [{shard.start}, {shard.stop}) is "
                         f"not aligned to {per_element} (packing / scale block)")
    return source.get_slice(name, 1, shard.start // per_element, shard.stop // per_element)


def place(target: torch.Tensor, tensor: torch.Tensor, shard: Shard, name: str) -> None:
    """Copy a loaded slice into `target` at output row `shard.offset`, checking its shape."""
    rows = tensor.shape[0] if tensor.dim() else 0
    if tensor.dim() != target.dim() or shard.offset + rows > target.shape[0]:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}; the layer "
                         f"expects rows {shard.offset}..{shard.offset + rows} of {tuple(target.shape)}")
    dest = target.data.narrow(0, shard.offset, rows)
    if dest.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}; the layer "
                         f"expects {tuple(dest.shape)}")
    dest.copy_(tensor.to(dest.dtype))


def finish_loading(model: nn.Module, dtype: torch.dtype) -> None:
    """Run every linear layer's `finish` once the checkpoint is loaded."""
    for module in model.modules():
        method = getattr(module, "method", None)
        if isinstance(method, LinearMethod):
            method.finish(module, dtype)
