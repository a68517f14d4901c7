"""NVFP4 linear layers as reference for the kernels: W4A4 (SM120 GEMM) and W4A16 (GEMV).

W4A4 computes what the block-scaled MMA computes: products of dequantized operands, which
are exact in fp32, summed in fp32, times `alpha = input_scale * weight_scale_2`.
"""
from __future__ import annotations

import torch

from .quantize import dequantize, quantize_activation


def nvfp4_matmul(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor,
                 b_scale: torch.Tensor, alpha: torch.Tensor | float,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """D[m,n] = alpha * (A ⊙ SFA) · (B ⊙ SFB)^T with row-major scales, fp32 accumulation."""
    a = dequantize(a_data, a_scale)
    b = dequantize(b_data, b_scale)
    acc = a @ b.T
    return (acc * torch.as_tensor(alpha, dtype=torch.float32, device=acc.device)).to(out_dtype)


def nvfp4_linear_w4a4(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """y = x W^T with x quantized to NVFP4 by its static input_scale, output in x.dtype."""
    lead = x.shape[:-1]
    xq = quantize_activation(x.reshape(-1, x.shape[-1]), input_scale)
    alpha = torch.as_tensor(input_scale, dtype=torch.float32) * weight_scale_2.to(torch.float32)
    y = nvfp4_matmul(xq.data, xq.scale, weight, weight_scale, alpha, out_dtype=x.dtype)
    return y.reshape(*lead, -1)


def nvfp4_linear_w4a16(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       weight_scale_2: torch.Tensor) -> torch.Tensor:
    """y = x · dequant(W)^T in fp32, output in x.dtype (the GEMV and Hopper fallback path)."""
    w = dequantize(weight, weight_scale, weight_scale_2)
    return (x.to(torch.float32) @ w.T).to(x.dtype)
