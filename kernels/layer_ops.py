"""The small elementwise steps of a decoder layer on the op-by-op path (prefill, mixed steps):
SwiGLU (torch's) and rotate-half RoPE: its torch reference, and a native CPU variant that runs
the fused decode block's function (csrc/cpu/layer_ops_avx2.cpp, the same roundings as the
reference) on the kernels' thread pool, so torch's ops stay off the cores."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_lib


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over the last dim of x = [gate | up]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # the product written into silu's output: one tensor fewer


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of `[T, heads, D]` with cos/sin `[T, 1, D/2]`: Hugging Face's
    `x * cos + rotate_half(x) * sin` with cos/sin of half width; the first half becomes
    x1·cos − x2·sin, the second x2·cos + x1·sin (the same roundings), in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    o1.sub_(x2 * sin)
    torch.mul(x2, cos, out=o2)
    o2.add_(x1 * sin)
    return out.to(x.dtype)


def rotate_halves_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One native call for fp32 CPU `[T, heads, D]` (a token's heads contiguous); anything else
    runs the reference."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 3 or x.stride()[1:] != (x.shape[2], 1) \
            or cos.dtype != torch.float32 or cos.numel() != x.shape[0] * (x.shape[2] // 2):
        return rotate_halves(x, cos, sin)
    half = x.shape[2] // 2
    return cpu_lib.rotary_halves(x, cos.reshape(-1, half), sin.reshape(-1, half))
