"""Where the blocks of a KV pool live in memory, and whether two pools can exchange blocks.

A pool is a list of contiguous tensors shaped `[num_blocks, ...]`; block b of tensor t is
`[base_t + b * block_bytes_t, + block_bytes_t)`. The transfer addresses block (t, b) by one
descriptor index, tensor-major, on each side: `offset_t + b` with `offset_t` the number of
blocks of the tensors before t. Prefill and decode run the same model, so tensor count and
block sizes must match; the number of blocks may differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch


class LayoutMismatch(ValueError):
    """The peer's KV pool cannot exchange blocks with ours (another model or shard?)."""


@dataclass(frozen=True)
class Region:
    base: int
    num_blocks: int
    block_bytes: int

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True)
class PoolLayout:
    mem_type: str  # NIXL memory type: "DRAM" (CPU) or "VRAM" (CUDA)
    dev_id: int
    regions: tuple[Region, ...]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> PoolLayout:
        if not tensors:
            raise ValueError("the KV pool has no tensors")
        device = tensors[0].device
        regions = []
        for i, t in enumerate(tensors):
            if t.device != device:
                raise ValueError(f"pool tensor {i} is on {t.device}, tensor 0 on {device}")
            if not t.is_contiguous() or t.dim() < 1 or t.shape[0] < 1:
                raise ValueError(f"pool tensor {i} must be contiguous [num_blocks >= 1, ...]")
            regions.append(Region(t.data_ptr(), t.shape[0], t.stride(0) * t.element_size()))
        if device.type == "cpu":
            return cls("DRAM", 0, tuple(regions))
        return cls("VRAM", device.index or 0, tuple(regions))

    @property
    def min_blocks(self) -> int:
        return min(r.num_blocks for r in self.regions)

    def check_compatible(self, other: PoolLayout, peer: str) -> None:
        """Raise LayoutMismatch with the first difference that prevents a block copy."""
        if len(self.regions) != len(other.regions):
            raise LayoutMismatch(f"KV layout mismatch with {peer}: {len(self.regions)} pool "
                                 f"tensors here, {len(other.regions)} there")
        for i, (a, b) in enumerate(zip(self.regions, other.regions)):
            if a.block_bytes != b.block_bytes:
                raise LayoutMismatch(f"KV layout mismatch with {peer}: tensor {i} has "
                                     f"{a.block_bytes} bytes per block here, "
                                     f"{b.block_bytes} there")

    def registration(self) -> list[tuple[int, int, int, str]]:
        """NIXL register_memory list: one region per tensor."""
        return [(r.base, r.nbytes, self.dev_id, "") for r in self.regions]

    def descriptors(self) -> np.ndarray:
        """Nx3 uint64 (address, length, device) for every block of every tensor, tensor-major."""
        parts = []
        for r in self.regions:
            rows = np.empty((r.num_blocks, 3), dtype=np.uint64)
            rows[:, 0] = r.base + np.arange(r.num_blocks, dtype=np.uint64) * r.block_bytes
            rows[:, 1] = r.block_bytes
            rows[:, 2] = self.dev_id
            parts.append(rows)
        return np.concatenate(parts)

    def blocks_valid(self, blocks: Sequence[int]) -> bool:
        limit = self.min_blocks
        return all(0 <= b < limit for b in blocks)

    def indices(self, blocks: Sequence[int]) -> np.ndarray:
        """Descriptor indices of `blocks` in every tensor, tensor-major (int32 for NIXL)."""
        offsets = np.cumsum([0] + [r.num_blocks for r in self.regions[:-1]], dtype=np.int64)
        idx = offsets[:, None] + np.asarray(blocks, dtype=np.int64)[None, :]
        return idx.reshape(-1).astype(np.int32)

    def to_dict(self) -> dict[str, Any]:
        return {"mem_type": self.mem_type, "dev_id": self.dev_id,
                "regions": [[r.base, r.num_blocks, r.block_bytes] for r in self.regions]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolLayout:
        return cls(str(d["mem_type"]), int(d["dev_id"]),
                   tuple(Region(int(a), int(n), int(s)) for a, n, s in d["regions"]))
