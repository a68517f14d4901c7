"""Compute kernels behind one op API (import name `pdserve_kernels`).

Each op has a torch reference (any device; every CPU test uses it) and may have native variants:
the CPU kernels of csrc/cpu (built by `make setup`) and the CUDA kernels of csrc/ (built by
`make kernels`). `configure(device, dtype, requested)` picks the backend once per process (see
dispatch.py); layers call the ops through this module (`pdserve_kernels.paged_attention(...)`),
so whatever was chosen is what runs. This package imports nothing from `pdserve`.
"""
from __future__ import annotations

import functools

from . import attention, attention_cpu, attention_cuda, cpu_lib, layer_blocks, layer_ops, norm, quant
from .dispatch import (Availability, Backend, KernelsUnavailable, Selection, configure, current,
                       register, register_library, select)

__all__ = ["Availability", "Backend", "KernelsUnavailable", "Selection", "backend_name", "configure",
           "current", "attention_block", "fused_layers", "mlp_block", "gather_kv", "is_native",
           "paged_attention", "qmatmul", "qmatmul_packed", "register", "register_library", "rms_norm",
           "rotate_halves", "select", "silu_and_mul", "store_kv"]

gather_kv = attention.gather_kv
silu_and_mul = layer_ops.silu_and_mul  # torch's, in every backend (docs/cpu-kernels.md)
rotate_halves = layer_ops.rotate_halves

# ---- native libraries: how each says whether it can run here ----------------------------
register_library("cpu", lambda dtype: cpu_lib.availability())
register_library("cuda", attention_cuda.availability)

# ---- ops: the torch reference, then the native variant per device type (one line each) ----
store_kv = register("store_kv", attention.store_kv)
paged_attention = register("paged_attention", attention.paged_attention,
                           cpu=attention_cpu.paged_attention_cpu, cuda=attention_cuda.paged_attention_cuda)
rms_norm = register("rms_norm", norm.rms_norm, cpu=norm.rms_norm_cpu)
qmatmul = register("qmatmul", functools.partial(quant.qmatmul, force="torch"),
                   cpu=functools.partial(quant.qmatmul, force="native"))
# the same product through a Q4 matrix repacked for the int16-activation path (batch-1 decode)
qmatmul_packed = register("qmatmul_packed", quant.qmatmul_packed_reference, cpu=quant.qmatmul_packed_cpu)
# a decoder layer's step as two fused calls (models use them only when `is_native`)
attention_block = register("attention_block", layer_blocks.attention_block, cpu=layer_blocks.attention_block_cpu)
mlp_block = register("mlp_block", layer_blocks.mlp_block, cpu=layer_blocks.mlp_block_cpu)
# every layer of a TP = 1 step and the final norm as one call
fused_layers = register("fused_layers", layer_blocks.fused_layers, cpu=layer_blocks.fused_layers_cpu)


def is_native(op) -> bool:
    """Whether `op` (one of this module's ops) runs a native variant in this process: layers use
    a fused op only then, and keep their op-by-op path (each op its own choice) otherwise."""
    return op.impl is not None and op.impl is not op.reference


def backend_name() -> str:
    """The backend the op API dispatches to in this process ("torch" until `configure`)."""
    sel = current()
    return sel.backend.value if sel is not None else "torch"
