"""RMSNorm with the residual add fused in: the torch reference and the native CPU variant.

`rms_norm(x, residual, weight, eps)` returns `rms_norm(x + residual) * weight` and, when
`residual` is given, leaves the sum in `x` (callers pass a fresh activation nothing else reads,
and keep `x` as the next residual). fp32 only; the layer handles lower precisions itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_lib


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> torch.Tensor:
    """The reference: the in-place add, then torch's fused `rms_norm`."""
    if residual is not None:
        x = x.add_(residual)
    return F.rms_norm(x, weight.shape, weight, eps)


def rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """One native call for contiguous fp32 CPU rows (the add, the norm and the scale); anything
    else runs the reference."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 \
            or not x.is_contiguous() or weight.shape != x.shape[-1:] \
            or (residual is not None and (residual.dtype != torch.float32 or not residual.is_contiguous()
                                          or residual.shape != x.shape)):
        return rms_norm(x, residual, weight, eps)
    return cpu_lib.add_rms_norm(x, residual, weight, eps)
