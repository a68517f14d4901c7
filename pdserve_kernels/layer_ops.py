"""The small elementwise steps of a decoder layer, in torch: SwiGLU and rotate-half RoPE. The
op-by-op path runs them; the fused layer blocks' references compose them, and their native
variant (csrc/cpu/layer_ops_avx2.cpp) computes both bit for bit as these do
(docs/cpu-kernels.md, "Prompts through the fused blocks")."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
