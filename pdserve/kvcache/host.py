"""The second tier: copies of evicted device blocks kept in host memory, by name.

When the device pool evicts a cached block (`BlockAllocator._evict`), its bytes are copied
here under its name (the chained hash of `pdserve/block_names.py`); a later request whose
chain continues past the device's cached blocks into this tier gets fresh device blocks loaded
from here before the step's forward. Least recently saved or used copies are dropped first when the tier
is full; a copy being loaded this step is pinned and never dropped or overwritten.

Copies are issued inside `Scheduler.apply`, before the step's forward: the evicted block is
still intact when it is saved (nobody held it), and a loaded block is complete before anything
reads it. On a CPU they are plain copies on the loop thread. On CUDA the host tensors are pinned
(page-locked) and the copies are asynchronous, on a stream of the tier's own, so the loop thread
never waits for the device (with `--overlap` a synchronous copy would wait for the forward in
flight). The order on the device keeps every copy safe without the host waiting:

* the copy stream first waits for the compute stream, so a block is saved only once every
  forward queued before it has written it;
* the compute stream then waits for the copy stream, so the next forward neither overwrites a
  block being saved nor reads one being loaded;
* all copies share one stream, so a host block is never overwritten by a save while a load
  from it is still running, nor read by a load before the save into it has finished. Nothing on
  the host reads the tier's bytes.

Every step's saves and loads follow from the plan and the device's LRU order, so every TP rank
keeps an identical tier (it is in the digest).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import torch

from .pool import KVPool, zeroed
from pdserve.block_names import BlockHash


class HostTier:
    """`num_blocks` host copies of device blocks of `pool`, indexed by block name."""

    def __init__(self, pool: KVPool, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the host cache tier needs at least one block")
        device = pool.tensors()[0].device
        self.pool, self.num_blocks = pool, num_blocks
        shapes = [((num_blocks, *t.shape[1:]), t.dtype) for t in pool.tensors()]
        self.tensors = ([torch.zeros(shape, dtype=dtype, pin_memory=True) for shape, dtype in shapes]  # async copies
                        if device.type == "cuda" else zeroed(shapes, device))
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._empty: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # name → host block, oldest first
        self._pins: dict[BlockHash, int] = {}
        self.num_saved = self.num_loaded = self.num_dropped = 0

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def holds(self, name: BlockHash) -> bool:
        return name in self._lru

    def count_chain(self, names: list[BlockHash]) -> int:
        """How many leading names of `names` this tier holds."""
        n = 0
        for name in names:
            if name not in self._lru:
                break
            n += 1
        return n

    def pin(self, names: list[BlockHash]) -> None:
        for name in names:
            if name not in self._lru:
                raise RuntimeError("pinning a host block that is not cached")
            self._pins[name] = self._pins.get(name, 0) + 1

    def unpin(self, names: list[BlockHash]) -> None:
        for name in names:
            self._pins[name] -= 1
            if not self._pins[name]:
                del self._pins[name]

    def save(self, block: int, name: BlockHash) -> None:
        """Copy device block `block` here as `name` (the device is about to reuse it)."""
        if name in self._lru:
            self._lru.move_to_end(name)
            return
        hb = self._empty.popleft() if self._empty else self._drop_oldest()
        if hb is None:  # every copy is pinned by this step's loads: this one is lost
            return
        self._copy([(h[hb], d[block]) for h, d in zip(self.tensors, self.pool.tensors())])
        self._lru[name] = hb
        self.num_saved += 1

    def forget(self) -> None:
        """Drop every copy but the pinned ones (a load of this step still reads them)."""
        for name in [n for n in self._lru if n not in self._pins]:
            self._empty.append(self._lru.pop(name))

    def _drop_oldest(self) -> int | None:
        victim = next((n for n in self._lru if n not in self._pins), None)
        if victim is None:
            return None
        self.num_dropped += 1
        return self._lru.pop(victim)

    def load(self, name: BlockHash, block: int) -> None:
        """Copy the host copy `name` into device block `block`."""
        hb = self._lru[name]
        self._copy([(d[block], h[hb]) for h, d in zip(self.tensors, self.pool.tensors())])
        self._lru.move_to_end(name)
        self.num_loaded += 1

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (destination, source) pair: inline on a CPU, queued on the tier's stream on
        CUDA between the two waits that order it against the forwards (module docstring)."""
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        compute.wait_stream(self.stream)

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=8)
        h.update(repr((list(self._empty), sorted(self._pins.items()))).encode())
        for name, hb in self._lru.items():
            h.update(name + hb.to_bytes(4, "little"))
        return h.digest()

    def check_integrity(self) -> None:
        """Empty and named host blocks are disjoint and cover the tier; pins name copies."""
        named = set(self._lru.values())
        if len(named) != len(self._lru) or named & set(self._empty):
            raise RuntimeError("a host block is named twice or both named and empty")
        if len(named) + len(self._empty) != self.num_blocks:
            raise RuntimeError(f"host tier: empty {len(self._empty)} + cached {len(named)} != {self.num_blocks}")
        if not set(self._pins) <= set(self._lru):
            raise RuntimeError("a pinned host copy is not cached")
