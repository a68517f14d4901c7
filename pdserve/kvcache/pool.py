"""The KV pool: for each layer and declared cache tensor, one `[num_blocks, block_size, ...]` tensor."""
from __future__ import annotations

import logging

import torch

from .spec import CacheTensorSpec

logger = logging.getLogger(__name__)


class KVPool:
    """Cache memory for `num_blocks` blocks of `block_size` tokens.

    Block b of every tensor holds the same tokens, so one block id addresses a token range
    across all layers (what the allocator hands out and the transfer moves).
    """

    def __init__(self, num_layers: int, specs: list[CacheTensorSpec], num_blocks: int,
                 block_size: int, device: torch.device | str = "cpu"):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block; raise the KV cache budget")
        self.num_layers, self.specs = num_layers, specs
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers: list[dict[str, torch.Tensor]] = [
            {s.name: torch.zeros(num_blocks, block_size, *s.shape, dtype=s.dtype, device=device)
             for s in specs}
            for _ in range(num_layers)
        ]
        logger.info("KV pool: %d blocks x %d tokens, %.1f MiB", num_blocks, block_size,
                    self.bytes_per_block(num_layers, specs, block_size) * num_blocks / 2**20)

    @staticmethod
    def bytes_per_block(num_layers: int, specs: list[CacheTensorSpec], block_size: int) -> int:
        return num_layers * block_size * sum(s.bytes_per_token() for s in specs)

    @classmethod
    def blocks_for_budget(cls, budget_bytes: int, num_layers: int, specs: list[CacheTensorSpec],
                          block_size: int) -> int:
        """How many blocks a memory budget buys."""
        return budget_bytes // cls.bytes_per_block(num_layers, specs, block_size)

    def tensors(self) -> list[torch.Tensor]:
        """Every cache tensor, in a fixed order (layer-major): what the KV transfer registers."""
        return [layer[s.name] for layer in self.layers for s in self.specs]
