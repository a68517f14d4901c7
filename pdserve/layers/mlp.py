"""The gated (SwiGLU) feed-forward block of Llama-style and DeepSeek-style models."""
from __future__ import annotations

import torch
from torch import nn

import pdserve_kernels as ops
from pdserve.distributed import TPGroup
from pdserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pdserve.layers.quant import QuantConfig, linear_method


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up fused and column-parallel, down row-parallel.

    `prefix` is the checkpoint name of the block (e.g. "model.layers.3.mlp"), which picks each
    projection's quantization. `reduce=False` leaves the row-parallel sum to the caller, so a
    block whose output is added to others (shared experts) can share one all_reduce.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str, tp: TPGroup = TPGroup(),
                 quant: QuantConfig | None = None, reduce: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, tp=tp,
            method=linear_method(quant, [f"{prefix}.gate_proj", f"{prefix}.up_proj"]))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp, reduce=reduce,
                                           method=linear_method(quant, [f"{prefix}.down_proj"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
