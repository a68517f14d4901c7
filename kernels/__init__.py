"""Compute kernels behind one op API (import name `pdserve_kernels`).

Two backends: `torch` (the reference, any device, used by every CPU test) and, later, `sm120`
(CUTLASS kernels from csrc/, used when a capable GPU and the built library are present).
This package imports nothing from `pdserve`.
"""
from __future__ import annotations

from .attention import gather_kv, paged_attention, store_kv

__all__ = ["backend_name", "gather_kv", "paged_attention", "store_kv"]


def backend_name() -> str:
    """The backend the op API dispatches to in this process."""
    return "torch"
