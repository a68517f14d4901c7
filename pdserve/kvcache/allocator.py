"""Block allocator with reference counts and a prefix cache; its books balance exactly:

    empty + cached-unreferenced + referenced == total

* *referenced*: one or more sequences (or a KV transfer's room) hold the block. Its content
  is never overwritten and it is never evicted: `allocate` only hands out empty blocks and
  evicts only unreferenced ones.
* *cached* (unreferenced): nobody holds it, but it keeps a computed block whose name (its
  chained hash, `pdserve/block_names.py`) is in the index, so a later request with the same
  prefix can take it back (`acquire`). These are evicted least recently released first, and
  only when an allocation finds no empty block.
* *empty*: no holder, no content worth keeping.

A cached block is either *named* (full: its chained hash is in the index) or a *tail*: the
last, partly filled block of a released sequence, kept under the name of the block before it
(`Tail`). A tail is never shared: a later request whose tokens continue the same chain takes it
whole (`take_tail`) and writes its own tokens after the matching ones, which is how a turn
that resends a conversation reuses the conversation's last few tokens too (docs/prefix-cache.md).

`num_free` counts what an allocation can have (empty + cached-unreferenced); `num_used`
counts referenced blocks; so `num_free + num_used == num_blocks` as before the cache existed.

Deterministic: the same calls in the same order give the same ids, the same evictions and the
same index, which is what keeps tensor-parallel ranks' block tables identical without talking.
A second tier (`host.HostTier`, optional) sits behind `_evict`: an evicted block's bytes are
saved there under its name, and `host_chain` says how far a chain continues there.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass

from pdserve.block_names import BlockHash

from .host import HostTier


MAX_TAILS_PER_PARENT = 4  # more would make a lookup scan many; a fifth one is not kept


class OutOfBlocks(Exception):
    """Raised when an allocation asks for more blocks than are free (nothing is taken)."""


@dataclass(frozen=True)
class Tail:
    """A sequence's last, partly filled block: its first `len(tokens)` positions hold the KV of
    `tokens`, which follow the chain whose last full block is named `parent` (the salt when
    there is none)."""

    block: int
    parent: BlockHash
    tokens: tuple[int, ...]


class BlockAllocator:
    """Hands out block ids, counts their holders, indexes full blocks by content and keeps
    released sequences' partly filled last blocks as tails.

    With `caching=False` the index stays empty: released blocks go straight back to empty and
    `lookup` finds nothing, so the allocator behaves as a plain free list."""

    def __init__(self, num_blocks: int, caching: bool = False, host: HostTier | None = None):
        self.num_blocks = num_blocks
        self.caching = caching
        self.host = host if caching else None
        self._empty: deque[int] = deque(range(num_blocks))
        self._refs: dict[int, int] = {}                    # block → holders (> 0)
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._name: dict[int, BlockHash] = {}              # block → its content's name
        self._block: dict[BlockHash, int] = {}             # name → the block that holds it
        self._tail: dict[int, Tail] = {}                   # tail block → what it holds
        self._tails: dict[BlockHash, list[int]] = {}       # parent name → its tails, oldest first
        self.num_evictions = 0
        self.num_queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.num_hits = 0     # of which found cached (vLLM's prefix_cache_hits)
        self.num_host_hits = 0  # of which loaded back from the host tier
        self.num_forgotten = 0  # cached blocks dropped by `forget` (a prefix cache reset)

    # ---- counts -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have now: empty, plus cached ones nobody holds (evictable)."""
        return len(self._empty) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Referenced blocks."""
        return len(self._refs)

    @property
    def num_empty(self) -> int:
        return len(self._empty)

    @property
    def num_cached(self) -> int:
        """Cached blocks nobody holds (evictable)."""
        return len(self._lru)

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)

    def is_cached(self, block: int) -> bool:
        """The block's content is named in the index (held or not)."""
        return block in self._name

    # ---- allocation ---------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """n blocks, each with one holder: empty ones first, then the least recently released
        cached ones (evicted: their names leave the index). Never a referenced block."""
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            b = self._empty.popleft() if self._empty else self._evict()
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def _evict(self) -> int:
        b, _ = self._lru.popitem(last=False)
        self.num_evictions += 1
        if b in self._tail:  # a partial block: nothing for the host tier
            self._drop_tail(b)
            return b
        name = self._name.pop(b)
        del self._block[name]
        if self.host is not None:  # its bytes are still intact: nobody held it
            self.host.save(b, name)
        return b

    def free(self, blocks: list[int], tail: Tail | None = None) -> None:
        """Drop one holder of each block. A block left without holders stays cached if its
        content is named, or if it is `tail.block` (the sequence's partly filled last block)
        and its parent keeps fewer than MAX_TAILS_PER_PARENT tails; else it becomes empty.
        Most recently released last; a table's end is released first, so a shared prefix
        outlives the private ends. Freeing a block without holders is a bug in the caller:
        nothing is changed and ValueError is raised."""
        counts: dict[int, int] = {}
        for b in blocks:
            counts[b] = counts.get(b, 0) + 1
            if counts[b] > self._refs.get(b, 0):
                raise ValueError(f"block {b} is not allocated")
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            del self._refs[b]
            if b in self._name or (tail is not None and b == tail.block and self._keep_tail(tail)):
                self._lru[b] = None
            else:
                self._empty.append(b)

    def _keep_tail(self, tail: Tail) -> bool:
        if not self.caching or not tail.tokens or len(self._tails.get(tail.parent, ())) >= MAX_TAILS_PER_PARENT:
            return False
        self._tails.setdefault(tail.parent, []).append(tail.block)
        self._tail[tail.block] = tail
        return True

    def _drop_tail(self, block: int) -> None:
        tail = self._tail.pop(block)
        siblings = self._tails[tail.parent]
        siblings.remove(block)
        if not siblings:
            del self._tails[tail.parent]

    # ---- the prefix cache ---------------------------------------------------------------------

    def lookup(self, names: list[BlockHash]) -> list[int]:
        """The blocks holding the longest cached prefix of a chain of block names."""
        out = []
        if self.caching:
            for name in names:
                b = self._block.get(name)
                if b is None:
                    break
                out.append(b)
        return out

    def find_tail(self, parent: BlockHash, tokens: list[int],
                  skip: set[int] = frozenset()) -> tuple[int, int]:
        """The tail after `parent` that holds the longest start of `tokens` (the oldest among
        equals), as (block, tokens matched); (-1, 0) when none matches a token. `skip`: tails the
        step's plan already gave to another request."""
        best, matched = -1, 0
        if self.caching:
            for b in self._tails.get(parent, ()):
                if b in skip:
                    continue
                n = 0
                for have, want in zip(self._tail[b].tokens, tokens):
                    if have != want:
                        break
                    n += 1
                if n > matched:
                    best, matched = b, n
        return best, matched

    def take_tail(self, block: int) -> None:
        """A request takes a tail whole: it holds it alone and writes after the matched tokens
        (so it leaves the cache: nobody else could rely on its later positions)."""
        if block not in self._tail:
            raise ValueError(f"block {block} is not a cached tail")
        self._drop_tail(block)
        del self._lru[block]
        self._refs[block] = 1

    def host_chain(self, names: list[BlockHash]) -> int:
        """How many of `names` (the continuation of a device hit) the host tier holds."""
        return self.host.count_chain(names) if self.host is not None else 0

    def load(self, names: list[BlockHash]) -> list[int]:
        """Fresh device blocks holding the host tier's copies of `names`, named and held once.
        The copies are pinned while the allocation evicts (and saves) other blocks."""
        self.host.pin(names)
        try:
            blocks = self.allocate(len(names))
            for name, b in zip(names, blocks):
                self.host.load(name, b)
                self.register(b, name)
        finally:
            self.host.unpin(names)
        return blocks

    def acquire(self, blocks: list[int]) -> None:
        """Add one holder to each (cached) block: a sequence reuses them."""
        for b in blocks:
            if b not in self._name:
                raise ValueError(f"block {b} holds no cached content")
            if b in self._lru:
                del self._lru[b]
            self._refs[b] = self._refs.get(b, 0) + 1

    def register(self, block: int, name: BlockHash) -> None:
        """Name a held block's (now complete) content. If another block already holds that
        name the index keeps the first one and this block stays private (empty when freed)."""
        if not self.caching:
            return
        if block not in self._refs:
            raise ValueError(f"block {block} is not allocated")
        have = self._name.get(block)
        if have is not None:
            if have != name:
                raise RuntimeError(f"block {block} is renamed: its content changed while cached")
            return
        if name not in self._block:
            self._block[name] = block
            self._name[block] = name

    def forget(self) -> int:
        """Forget everything cached, so that no later request reuses KV computed before now:
        unreferenced cached blocks (tails too) become empty, held blocks keep their holders and
        content but lose their names (freed, they become empty), and the host tier drops its
        copies (bar those a load of this step pinned). Returns the device blocks that were
        cached and unreferenced."""
        dropped = len(self._lru)
        self._empty.extend(self._lru)
        for book in (self._lru, self._name, self._block, self._tail, self._tails):
            book.clear()
        if self.host is not None:
            self.host.forget()
        self.num_forgotten += dropped
        return dropped

    def count_query(self, queried: int, hit: int) -> None:
        """Count a lookup's tokens (the counters behind the prefix cache hit rate)."""
        self.num_queries += queried
        self.num_hits += hit

    # ---- checks -------------------------------------------------------------------------------

    def digest(self) -> str:
        """A digest of the whole state (holders, LRU order, index): equal on every TP rank."""
        h = hashlib.blake2b(digest_size=8)
        h.update(repr((list(self._empty), sorted(self._refs.items()), list(self._lru))).encode())
        for b, name in sorted(self._name.items()):
            h.update(b.to_bytes(4, "little") + name)
        h.update(repr(sorted(self._tails.items())).encode())
        for b, tail in sorted(self._tail.items()):
            h.update(repr((b, tail.tokens)).encode())
        if self.host is not None:
            h.update(self.host.digest())
        return h.hexdigest()

    def check_integrity(self) -> None:
        """Raise if the books do not balance: empty, cached-unreferenced and referenced are
        disjoint and cover every block; the index is a bijection over named blocks; every
        unreferenced cached block is named."""
        empty = set(self._empty)
        lru, refs = set(self._lru), set(self._refs)
        if len(empty) != len(self._empty):
            raise RuntimeError("a block is on the empty list twice")
        for a, b, what in ((empty, lru, "empty and cached"), (empty, refs, "empty and used"),
                           (lru, refs, "cached-unreferenced and used")):
            if a & b:
                raise RuntimeError(f"blocks both {what}: {sorted(a & b)[:8]}")
        if len(empty) + len(lru) + len(refs) != self.num_blocks:
            raise RuntimeError(f"empty {len(empty)} + cached {len(lru)} + used {len(refs)} "
                               f"!= total {self.num_blocks}")
        if any(n <= 0 for n in self._refs.values()):
            raise RuntimeError("a referenced block has no holder")
        tails = set(self._tail)
        if not lru <= set(self._name) | tails:
            raise RuntimeError("an unreferenced cached block is neither named nor a tail")
        if not tails <= lru or tails & set(self._name):
            raise RuntimeError("a tail is held, or also named")
        indexed = [(p, b) for p, blocks in self._tails.items() for b in blocks]
        if sorted(b for _, b in indexed) != sorted(tails) or any(
                self._tail[b].parent != p or self._tail[b].block != b for p, b in indexed):
            raise RuntimeError("the tail index and the tails disagree")
        if empty & set(self._name):
            raise RuntimeError("an empty block is still named in the index")
        if len(self._block) != len(self._name) or any(self._block.get(n) != b for b, n in self._name.items()):
            raise RuntimeError("the prefix index and the block names disagree")
        if self.host is not None:
            self.host.check_integrity()
