"""RMSNorm, with the residual add fused in (the sum is written in place: one pass fewer)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused kernel; the same arithmetic as below (equal to it bit for bit in fp32)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
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
