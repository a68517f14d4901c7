"""Paged KV cache: declared cache tensors, the block pool, and the block allocator."""
from .allocator import BlockAllocator, OutOfBlocks
from .pool import KVPool
from .spec import CacheTensorSpec

__all__ = ["BlockAllocator", "CacheTensorSpec", "KVPool", "OutOfBlocks"]
