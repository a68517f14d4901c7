"""RMSNorm, with the residual add fused in (the sum is written in place: one pass fewer)."""
from __future__ import annotations

import torch
from torch import nn

import pdserve_kernels as ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # lower precision: normalize in fp32, round, then scale, as transformers does
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the sum
        written into `x`: callers pass a fresh activation (a layer's output) that nothing else
        reads, so no new tensor is needed."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the op API: torch's fused rms_norm (the same arithmetic as `_norm`, bit for bit in
            # fp32), or one native call for the add and the norm
            out = ops.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, x)
        if residual is None:
            return self._norm(x)
        x = x.add_(residual)
        return self._norm(x), x

    def load(self, param: str, source, name: str, shard_id: object = None) -> None:
        self.weight.data.copy_(source.get_slice(name, 0, 0, self.weight.shape[0], self.weight.dtype))


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm (weight and bias), loadable from a checkpoint like the other layers."""

    def load(self, param: str, source, name: str, shard_id: object = None) -> None:
        p = getattr(self, param)
        p.data.copy_(source.get_slice(name, 0, 0, p.shape[0], p.dtype))
