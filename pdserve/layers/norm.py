"""RMSNorm, with the residual add fused in (one pass instead of two)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def load(self, param: str, source, name: str, shard_id: object = None) -> None:
        self.weight.data.copy_(source.get_slice(name, 0, 0, self.weight.shape[0], self.weight.dtype))


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm (weight and bias), loadable from a checkpoint like the other layers."""

    def load(self, param: str, source, name: str, shard_id: object = None) -> None:
        p = getattr(self, param)
        p.data.copy_(source.get_slice(name, 0, 0, p.shape[0], p.dtype))
