"""The KV pool: for each layer and each cache tensor it declares, one `[num_blocks, block_size, ...]`
tensor. Layers may declare different tensors (a GLM-5 layer that reuses another's top-k keeps no
index keys)."""
from __future__ import annotations

import logging
import math
import mmap
import os

import torch

from .spec import CacheTensorSpec

logger = logging.getLogger(__name__)


def zeroed(shapes: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """Zero tensors of these (shape, dtype)s: the memory of a KV pool or of a host tier.

    On the CPU they share one shared-memory file ("pdserve-kv" in /proc/<pid>/maps), whose pages
    the kernel zeroes as they are first written. A pool then costs resident memory only for the
    blocks it has used: its size is a bound, not an up-front cost, so workers on one host fit
    beside each other. Being shared memory, it is counted apart from the process's heap (RssShmem
    against RssAnon), which keeps leak checks on the heap meaningful as the pool fills. A block's
    first write pays its page faults instead (≈ 0.35 ms a MiB, what zeroing it at start cost).
    """
    if device.type != "cpu" or not hasattr(os, "memfd_create"):  # a GPU, or not Linux: zeroed up front
        return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in shapes]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + -(-n // mmap.PAGESIZE) * mmap.PAGESIZE)
    fd = os.memfd_create("pdserve-kv", os.MFD_CLOEXEC)
    try:
        size = max(offsets[-1], mmap.PAGESIZE)
        os.ftruncate(fd, size)
        arena = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)  # the tensors keep the mapping
    finally:
        os.close(fd)
    return [arena[at:at + n].view(dtype).view(shape) for (shape, dtype), at, n in zip(shapes, offsets, sizes)]


class KVPool:
    """Cache memory for `num_blocks` blocks of `block_size` tokens.

    Block b of every tensor holds the same tokens, so one block id addresses a token range
    across all layers (what the allocator hands out and the transfer moves).
    """

    def __init__(self, layer_specs: list[list[CacheTensorSpec]], num_blocks: int,
                 block_size: int, device: torch.device | str = "cpu"):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block; raise the KV cache budget")
        self.layer_specs = layer_specs
        self.num_blocks, self.block_size = num_blocks, block_size
        memory = iter(zeroed([((num_blocks, block_size, *s.shape), s.dtype) for specs in layer_specs for s in specs],
                             torch.device(device)))
        self.layers: list[dict[str, torch.Tensor]] = [{s.name: next(memory) for s in specs} for specs in layer_specs]
        logger.info("KV pool: %d blocks x %d tokens, %.1f MiB (%s)", num_blocks, block_size,
                    self.bytes_per_block(layer_specs, block_size) * num_blocks / 2**20,
                    ", ".join(sorted({str(s.dtype).removeprefix("torch.") for specs in layer_specs for s in specs})))

    @property
    def num_layers(self) -> int:
        return len(self.layer_specs)

    @staticmethod
    def bytes_per_token(layer_specs: list[list[CacheTensorSpec]]) -> int:
        """Cache bytes one token takes, over all layers."""
        return sum(s.bytes_per_token() for specs in layer_specs for s in specs)

    @classmethod
    def bytes_per_block(cls, layer_specs: list[list[CacheTensorSpec]], block_size: int) -> int:
        return block_size * cls.bytes_per_token(layer_specs)

    @classmethod
    def blocks_for_budget(cls, budget_bytes: int, layer_specs: list[list[CacheTensorSpec]],
                          block_size: int) -> int:
        """How many blocks a memory budget buys."""
        return budget_bytes // cls.bytes_per_block(layer_specs, block_size)

    def tensors(self) -> list[torch.Tensor]:
        """Every cache tensor, in a fixed order (layer-major): what the KV transfer registers."""
        return [t for layer in self.layers for t in layer.values()]
