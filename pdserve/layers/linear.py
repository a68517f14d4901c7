"""Linear layers that shard over a tensor-parallel group.

Column-parallel layers split the output features (no communication); row-parallel layers split
the input features and sum the partial products with one all_reduce. Each layer loads its own
slice of a checkpoint tensor, so a rank reads only its shard.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed import TPGroup


class WeightSlices:
    """Reads a checkpoint tensor, or a slice of it along one dim (implemented by weights.WeightSource)."""

    def get_slice(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype | None = None
                  ) -> torch.Tensor: ...  # pragma: no cover - protocol


class ReplicatedLinear(nn.Module):
    """The full matrix on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = TPGroup()):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, param: str, source: WeightSlices, name: str, shard_id: object = None) -> None:
        target = getattr(self, param)
        target.data.copy_(source.get_slice(name, 0, 0, target.shape[0], target.dtype))


class ColumnParallelLinear(ReplicatedLinear):
    """Output features split across ranks; each rank produces its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = TPGroup()):
        start, stop = tp.shard(out_features)
        super().__init__(in_features, stop - start, bias, tp)
        self.out_features = out_features

    def load(self, param: str, source: WeightSlices, name: str, shard_id: object = None) -> None:
        target = getattr(self, param)
        start, stop = self.tp.shard(self.out_features)
        target.data.copy_(source.get_slice(name, 0, start, stop, target.dtype))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one (gate and up): one matmul instead of many."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp: TPGroup = TPGroup()):
        super().__init__(in_features, sum(output_sizes), bias, tp)
        self.output_sizes = output_sizes

    def load(self, param: str, source: WeightSlices, name: str, shard_id: object = None) -> None:
        assert isinstance(shard_id, int)
        target = getattr(self, param)
        local = [n // self.tp.size for n in self.output_sizes]
        offset = sum(local[:shard_id])
        start, stop = self.tp.shard(self.output_sizes[shard_id])
        target.data[offset:offset + local[shard_id]].copy_(
            source.get_slice(name, 0, start, stop, target.dtype))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, heads split across ranks.

    With fewer KV heads than ranks, each KV head is replicated on `size // kv_heads` ranks.
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPGroup = TPGroup()):
        if num_heads % tp.size:
            raise ValueError(f"{num_heads} attention heads do not split over TP size {tp.size}")
        if num_kv_heads % tp.size and tp.size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads neither split nor replicate over TP size {tp.size}")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.total_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        ReplicatedLinear.__init__(self, hidden, out, bias, tp)

    def kv_head_range(self) -> tuple[int, int]:
        """The checkpoint KV heads this rank holds."""
        if self.total_kv_heads >= self.tp.size:
            first = self.tp.rank * self.num_kv_heads
        else:
            first = self.tp.rank // (self.tp.size // self.total_kv_heads)
        return first, first + self.num_kv_heads

    def load(self, param: str, source: WeightSlices, name: str, shard_id: object = None) -> None:
        target = getattr(self, param)
        d = self.head_dim
        q_rows = self.num_heads * d
        kv_rows = self.num_kv_heads * d
        if shard_id == "q":
            first, offset, rows = self.tp.rank * self.num_heads, 0, q_rows
        else:
            first = self.kv_head_range()[0]
            offset, rows = (q_rows, kv_rows) if shard_id == "k" else (q_rows + kv_rows, kv_rows)
        target.data[offset:offset + rows].copy_(
            source.get_slice(name, 0, first * d, first * d + rows, target.dtype))


class RowParallelLinear(ReplicatedLinear):
    """Input features split across ranks; partial outputs summed with one all_reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = TPGroup()):
        start, stop = tp.shard(in_features)
        super().__init__(stop - start, out_features, bias, tp)
        self.in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def load(self, param: str, source: WeightSlices, name: str, shard_id: object = None) -> None:
        if param == "bias":
            return super().load(param, source, name)
        start, stop = self.tp.shard(self.in_features)
        self.weight.data.copy_(source.get_slice(name, 1, start, stop, self.weight.dtype))
