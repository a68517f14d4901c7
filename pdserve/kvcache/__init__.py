"""Paged KV cache: declared cache tensors, the block pool, the block allocator and its prefix
cache (blocks named by a chained hash of their tokens)."""
from pdserve.block_names import BlockHash, block_hashes, extend_hashes, salt_of

from .allocator import BlockAllocator, OutOfBlocks, Tail
from .host import HostTier
from .pool import KVPool
from .spec import CacheTensorSpec

__all__ = ["BlockAllocator", "BlockHash", "HostTier", "CacheTensorSpec", "KVPool", "OutOfBlocks", "block_hashes",
           "extend_hashes", "salt_of", "Tail"]
