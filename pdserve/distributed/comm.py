"""The two collectives of a lockstep step, on the control group: agree and broadcast.

Both move fixed-size byte buffers, so no collective's shape ever depends on a rank's local
state: `agree` gathers every rank's observations to rank 0, `broadcast` sends rank 0's plan to
every rank. A single-rank worker uses `LocalComm`, which does neither.

A plan may outgrow its buffer: one admitted request carries its whole prompt and grammar (a
128k-token prompt pickles to ≈ 640 KB with a vocabulary past 65,536 ids; a forced call over many
large tools, to hundreds of KB). The buffer then carries the plan's first bytes and its length,
and a second broadcast carries the rest: its size is what rank 0 wrote in the first, so every
rank enters it, with the same shape. Observations are bounded by their sender (the loop takes
a step's transfer outcomes by count and bytes) and stay within half of one buffer.
"""
from __future__ import annotations

import pickle
import struct
from typing import Any

import torch
import torch.distributed as dist

from .trace import CollectiveTrace

_HEADER = struct.Struct("<Q")


class MessageTooLarge(Exception):
    """A message does not fit its fixed buffer (the sender must send less per step)."""


def frame(obj: Any) -> bytes:
    """`obj` as sent: its pickle's length, then the pickle."""
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def pack(obj: Any, buf: torch.Tensor) -> torch.Tensor:
    """Write `obj` into the fixed-size byte tensor `buf` (length header, then pickle)."""
    data = frame(obj)
    if len(data) > buf.numel():
        raise MessageTooLarge(f"{len(data)} bytes do not fit a {buf.numel()}-byte buffer")
    buf.numpy()[:len(data)] = memoryview(data)
    return buf


def unpack(buf: torch.Tensor) -> Any:
    view = buf.numpy()
    (n,) = _HEADER.unpack_from(view[:_HEADER.size].tobytes())
    return pickle.loads(view[_HEADER.size:_HEADER.size + n].tobytes())


class LocalComm:
    """One rank: agree returns this rank's observation, broadcast returns the plan as is."""

    rank, size = 0, 1
    plan_bytes: int | None = None  # no limit: nothing is sent
    observation_bytes: int | None = None

    def __init__(self, trace: CollectiveTrace | None = None) -> None:
        self.trace = trace or CollectiveTrace()

    def agree(self, observation: Any) -> list[Any] | None:
        self.trace.record("agree")
        return [observation]

    def broadcast(self, plan: Any) -> Any:
        self.trace.record("broadcast")
        return plan


class GroupComm(LocalComm):
    """Ranks of one TP group over a (gloo) control process group."""

    def __init__(self, rank: int, size: int, group: Any, observation_bytes: int = 1 << 14,
                 plan_bytes: int = 1 << 17, trace: CollectiveTrace | None = None):
        super().__init__(trace)
        self.rank, self.size, self.group = rank, size, group
        self.observation_bytes, self.plan_bytes = observation_bytes, plan_bytes
        self._plan_buf = torch.zeros(plan_bytes, dtype=torch.uint8)
        self._obs_buf = torch.zeros(observation_bytes, dtype=torch.uint8)
        self._obs_parts = [torch.zeros(observation_bytes, dtype=torch.uint8) for _ in range(size)]

    def agree(self, observation: Any) -> list[Any] | None:
        """Every rank's observation, at rank 0 (None elsewhere). One gather of fixed size."""
        self.trace.record("agree")
        mine = pack(observation, self._obs_buf)
        parts = self._obs_parts if self.rank == 0 else None
        dist.gather(mine, parts, dst=0, group=self.group)
        return [unpack(p) for p in parts] if parts is not None else None

    def broadcast(self, plan: Any) -> Any:
        """Rank 0's plan on every rank: one broadcast of fixed size, and a second one for the rest
        of a plan that does not fit (its size read from the first)."""
        self.trace.record("broadcast")
        buf = self._plan_buf
        data = frame(plan) if self.rank == 0 else b""
        if self.rank == 0:
            head = min(len(data), buf.numel())
            buf.numpy()[:head] = memoryview(data)[:head]
        dist.broadcast(buf, src=0, group=self.group)
        (n,) = _HEADER.unpack_from(buf.numpy()[:_HEADER.size].tobytes())
        size = _HEADER.size + n
        if size <= buf.numel():
            return plan if self.rank == 0 else unpack(buf)
        self.trace.record("broadcast-rest")
        rest = torch.zeros(size - buf.numel(), dtype=torch.uint8)
        if self.rank == 0:
            rest.numpy()[:] = memoryview(data)[buf.numel():]
        dist.broadcast(rest, src=0, group=self.group)
        if self.rank == 0:
            return plan
        return pickle.loads(buf.numpy()[_HEADER.size:].tobytes() + rest.numpy().tobytes())
