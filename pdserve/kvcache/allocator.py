"""Block allocator with exact accounting: free + used == total, always."""
from __future__ import annotations

from collections import deque


class OutOfBlocks(Exception):
    """Raised when an allocation asks for more blocks than are free (nothing is taken)."""


class BlockAllocator:
    """Hands out block ids. Deterministic: the same calls in the same order give the same ids,
    which is what lets tensor-parallel ranks keep identical block tables without talking."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool. Freeing a block that is not in use is a bug in the caller."""
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated")
            self._used.remove(b)
            self._free.append(b)

    def check_integrity(self) -> None:
        """Raise if the books do not balance (free and used disjoint and covering every block)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("a block is on the free list twice")
        if free & self._used:
            raise RuntimeError(f"blocks both free and used: {sorted(free & self._used)[:8]}")
        if len(free) + len(self._used) != self.num_blocks:
            raise RuntimeError(f"free {len(free)} + used {len(self._used)} != total {self.num_blocks}")
