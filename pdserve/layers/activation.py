"""SwiGLU: silu(gate) * up over a merged [gate | up] projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # the product written into silu's output: one tensor fewer
