"""Linear layers that shard over a tensor-parallel group.

Column-parallel layers split the output features (no communication); row-parallel layers split
the input features and sum the partial products with one all_reduce. Each layer loads its own
slice of a checkpoint tensor, so a rank reads only its shard. How the weight is stored and
multiplied (plain or NVFP4) belongs to the layer's `LinearMethod` (pdserve.layers.quant).
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed import TPGroup
from pdserve.layers.quant import LinearMethod, Shard, UnquantizedLinearMethod, place, read_shard


class WeightSlices:
    """Reads a checkpoint tensor, or a slice of it along one dim (implemented by weights.WeightSource)."""

    def get_slice(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype | None = None
                  ) -> torch.Tensor: ...  # pragma: no cover - protocol


class ReplicatedLinear(nn.Module):
    """The full matrix on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = TPGroup(), method: LinearMethod | None = None):
        super().__init__()
        self.tp = tp
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, in_features, out_features)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def shard(self, shard_id: object) -> Shard:
        """Which slice of the checkpoint tensor (part `shard_id` if fused) this rank reads."""
        return Shard(0, 0, self.weight.shape[0], 0, 0)

    def load(self, param: str, source: WeightSlices, name: str, shard_id: object = None) -> None:
        shard = self.shard(shard_id)
        if param == "bias":
            if shard.dim != 0:  # row-parallel: the bias is added once, after the all_reduce
                shard = Shard(0, 0, self.bias.shape[0], 0, 0)
            place(self.bias, read_shard(source, name, shard), shard, name)
        else:
            self.method.load(self, param, source, name, shard)


class ColumnParallelLinear(ReplicatedLinear):
    """Output features split across ranks; each rank produces its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = TPGroup(), method: LinearMethod | None = None):
        start, stop = tp.shard(out_features)
        super().__init__(in_features, stop - start, bias, tp, method)
        self.out_features = out_features

    def shard(self, shard_id: object) -> Shard:
        start, stop = self.tp.shard(self.out_features)
        return Shard(0, start, stop, 0, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one (gate and up): one matmul instead of many."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp: TPGroup = TPGroup(), method: LinearMethod | None = None):
        super().__init__(in_features, sum(output_sizes), bias, tp, method)
        self.output_sizes = output_sizes

    def shard(self, shard_id: object) -> Shard:
        assert isinstance(shard_id, int)
        local = [n // self.tp.size for n in self.output_sizes]
        start, stop = self.tp.shard(self.output_sizes[shard_id])
        return Shard(0, start, stop, sum(local[:shard_id]), shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, heads split across ranks.

    With fewer KV heads than ranks, each KV head is replicated on `size // kv_heads` ranks.
    """

    PARTS = ("q", "k", "v")

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPGroup = TPGroup(), method: LinearMethod | None = None):
        if num_heads % tp.size:
            raise ValueError(f"{num_heads} attention heads do not split over TP size {tp.size}")
        if num_kv_heads % tp.size and tp.size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads neither split nor replicate over TP size {tp.size}")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.total_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        ReplicatedLinear.__init__(self, hidden, out, bias, tp, method)

    def kv_head_range(self) -> tuple[int, int]:
        """The checkpoint KV heads this rank holds."""
        if self.total_kv_heads >= self.tp.size:
            first = self.tp.rank * self.num_kv_heads
        else:
            first = self.tp.rank // (self.tp.size // self.total_kv_heads)
        return first, first + self.num_kv_heads

    def shard(self, shard_id: object) -> Shard:
        d = self.head_dim
        q_rows = self.num_heads * d
        kv_rows = self.num_kv_heads * d
        if shard_id == "q":
            first, offset, rows = self.tp.rank * self.num_heads, 0, q_rows
        else:
            first = self.kv_head_range()[0]
            offset, rows = (q_rows, kv_rows) if shard_id == "k" else (q_rows + kv_rows, kv_rows)
        return Shard(0, first * d, first * d + rows, offset, self.PARTS.index(shard_id))


class RowParallelLinear(ReplicatedLinear):
    """Input features split across ranks; partial outputs summed with one all_reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = TPGroup(), method: LinearMethod | None = None, reduce: bool = True):
        start, stop = tp.shard(in_features)
        super().__init__(stop - start, out_features, bias, tp, method)
        self.in_features = in_features
        self.reduce = reduce  # False: the caller sums the partial outputs (with others, in one all_reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, None)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def shard(self, shard_id: object) -> Shard:
        start, stop = self.tp.shard(self.in_features)
        return Shard(1, start, stop, 0, 0)
