"""Which implementation each op of `pdserve_kernels` runs in this process.

Two backends: `torch` (the reference: any device, any dtype) and `native` (compiled kernels: the
CPU library from csrc/cpu on a CPU, the CUDA library from csrc/ on a GPU it has code for). An op
is registered with its torch reference and, optionally, a native variant per device type; an op
with no native variant for the device runs its reference under either backend.

`configure(device, dtype, requested)` chooses once per process (the engine calls it at start-up,
before the model loads), rebinds every op, and logs the choice; `requested="native"` when the
native kernels cannot run here raises `KernelsUnavailable` with the reason.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

logger = logging.getLogger(__name__)


class Backend(str, enum.Enum):
    TORCH = "torch"
    NATIVE = "native"


REQUESTS = ("auto", "torch", "native")


class KernelsUnavailable(RuntimeError):
    """`--kernels native` where no native kernels can run (the message says why)."""


@dataclass(frozen=True)
class Availability:
    """Whether a native library can run here; false with the reason when not."""

    ok: bool
    reason: str
    capability: tuple[int, int] | None = None

    def __bool__(self) -> bool:
        return self.ok


@dataclass
class Op:
    """One op: its torch reference, its native variants by device type, and what runs now."""

    name: str
    reference: Callable
    native: dict[str, Callable] = field(default_factory=dict)
    impl: Callable | None = None

    def __call__(self, *args, **kwargs):
        return (self.impl or self.reference)(*args, **kwargs)


@dataclass(frozen=True)
class Selection:
    """The backend chosen for a device, why, and which ops run natively under it."""

    backend: Backend
    device_type: str
    reason: str
    native_ops: tuple[str, ...] = ()
    torch_ops: tuple[str, ...] = ()

    def describe(self) -> str:
        text = f"{self.backend.value} on {self.device_type} ({self.reason})"
        if self.backend is Backend.NATIVE:
            text += f"; native: {', '.join(self.native_ops) or 'none'}"
            if self.torch_ops:
                text += f"; torch reference: {', '.join(self.torch_ops)}"
        return text


OPS: dict[str, Op] = {}
# device type → availability check of its native library
LIBRARIES: dict[str, Callable[[torch.dtype], Availability]] = {}
_current: Selection | None = None


def register(name: str, reference: Callable, **native: Callable) -> Op:
    """Add (or extend) op `name`: `register("q4_1_matmul", q4_1_matmul_torch, cpu=q4_1_matmul_native)`.
    The keyword names a device type; the variant runs there under the native backend."""
    op = OPS.get(name)
    if op is None:
        op = OPS[name] = Op(name, reference)
    op.native.update(native)
    if _current is not None:  # registered after the choice: follow it
        _bind(op, _current)
    return op


def register_library(device_type: str, check: Callable[[torch.dtype], Availability]) -> None:
    """The availability check of the native library for `device_type` (given the model dtype)."""
    LIBRARIES[device_type] = check


def select(device: str | torch.device, dtype: torch.dtype, requested: str = "auto") -> Selection:
    """The backend for `device` and model `dtype`: native when requested or when auto finds the
    library usable; torch when requested or when auto does not. Pure apart from the check."""
    if requested not in REQUESTS:
        raise ValueError(f"unknown kernels backend {requested!r}; choose one of {', '.join(REQUESTS)}")
    dev = torch.device(device).type
    if requested == "torch":
        return Selection(Backend.TORCH, dev, "--kernels torch")
    check = LIBRARIES.get(dev)
    avail = check(dtype) if check else Availability(False, f"no native kernels for device type {dev!r}")
    native_ops = tuple(sorted(n for n, op in OPS.items() if dev in op.native))
    if avail and not native_ops:
        avail = Availability(False, f"the {dev} library is loaded but no op has a native {dev} variant")
    if not avail:
        if requested == "native":
            raise KernelsUnavailable(f"--kernels native: the native {dev} kernels cannot run here: "
                                     f"{avail.reason}")
        return Selection(Backend.TORCH, dev, f"auto: native unavailable: {avail.reason}")
    torch_ops = tuple(sorted(n for n in OPS if n not in native_ops))
    why = "--kernels native" if requested == "native" else "auto"
    return Selection(Backend.NATIVE, dev, f"{why}: {avail.reason}", native_ops, torch_ops)


def configure(device: str | torch.device, dtype: torch.dtype, requested: str = "auto") -> Selection:
    """Choose (see `select`), bind every op to it, and log the choice once."""
    global _current
    sel = select(device, dtype, requested)
    for op in OPS.values():
        _bind(op, sel)
    if sel != _current:
        logger.info("kernels: %s", sel.describe())
    _current = sel
    return sel


def current() -> Selection | None:
    """The last `configure` choice of this process (None: never configured; ops run torch)."""
    return _current


def _bind(op: Op, sel: Selection) -> None:
    op.impl = op.native.get(sel.device_type) if sel.backend is Backend.NATIVE else None
    op.impl = op.impl or op.reference
