"""The allocator's prefix cache: random allocate / share / finish / abort / evict / forget
sequences keep the books exact (empty + cached-unreferenced + referenced == total), never hand
out or evict a referenced block, and a cache hit always names the content its block holds (a
tail: the tokens it matched, after the same chain); after a forget (a reset), nothing started
before it is found again."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kvcache import BlockAllocator, OutOfBlocks, Tail, block_hashes, salt_of

BS = 4
SALT = salt_of("test-model", "float32")
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 50, 60, 70, 80], [9] * 16, [], [1, 2, 3, 4, 5, 6]]


class Model:
    """The allocator plus a shadow of who holds what and which content each block has."""

    def __init__(self, num_blocks: int):
        self.a = BlockAllocator(num_blocks, caching=True)
        self.seqs: dict[int, list[int]] = {}       # live sequence → its block table
        self.tails: dict[int, Tail] = {}           # live sequence → its last block, when partly filled
        self.started: list[list[int]] = []          # every sequence's tokens (a later turn resends one)
        self.content: dict[int, object] = {}       # block → the content written into it
        self.next = 0

    def holders(self, b: int) -> int:
        return sum(table.count(b) for table in self.seqs.values())

    def start(self, tokens: list[int], register: bool) -> None:
        self.started.append(tokens)
        names = block_hashes(tokens, BS, SALT)
        usable = (len(tokens) - 1) // BS if tokens else 0
        hit = self.a.lookup(names[:usable])
        for b, name in zip(hit, names):
            assert self.content[b] == name  # the hit's block holds exactly that content
        parent = names[len(hit) - 1] if hit else SALT
        start = len(hit) * BS
        tail, matched = self.a.find_tail(parent, tokens[start:max(start, len(tokens) - 1)])
        if matched:  # the tail holds the next tokens' KV, after the same chain
            assert self.holders(tail) == 0
            kind, where, held = self.content[tail]
            assert (kind, where) == ("tail", parent) and held[:matched] == tuple(tokens[start:start + matched])
        need = -(-len(tokens) // BS) - len(hit)
        cost = sum(1 for b in hit if self.a.refcount(b) == 0)  # a tail costs one, like a fresh block
        if need + cost > self.a.num_free:
            with pytest.raises(OutOfBlocks):
                self.a.allocate(self.a.num_free + 1)
            return
        self.a.acquire(hit)
        taken = []
        if matched:
            self.a.take_tail(tail)
            taken = [tail]
            self.content[tail] = ("written by", self.next)  # past the matched tokens
        fresh = self.a.allocate(need - len(taken))
        for b in fresh:
            assert self.holders(b) == 0, f"block {b} handed out while held"
            self.content[b] = ("written by", self.next)  # its old content is overwritten
        table = hit + taken + fresh
        if register:  # the forward filled the full blocks: name them
            for i in range(len(hit), len(tokens) // BS):
                self.a.register(table[i], names[i])
                if self.a.is_cached(table[i]) and self.a.lookup(names[:i + 1])[-1:] == [table[i]]:
                    self.content[table[i]] = names[i]
        full = len(tokens) // BS
        if register and len(tokens) % BS:  # its last block, partly filled, may stay as a tail
            self.tails[self.next] = Tail(table[full], names[full - 1] if full else SALT, tuple(tokens[full * BS:]))
        self.seqs[self.next] = table
        self.next += 1

    def end(self, which: int) -> None:
        if self.seqs:
            key = sorted(self.seqs)[which % len(self.seqs)]
            tail = self.tails.pop(key, None)
            self.a.free(self.seqs.pop(key), tail)
            if tail is not None and self.holders(tail.block) == 0:
                self.content[tail.block] = ("tail", tail.parent, tail.tokens)

    def check(self) -> None:
        self.a.check_integrity()
        held = {b for t in self.seqs.values() for b in t}
        assert self.a.num_used == len(held)
        for b in held:
            assert self.a.refcount(b) == self.holders(b)
        assert self.a.num_empty + self.a.num_cached + self.a.num_used == self.a.num_blocks


ops = st.lists(st.one_of(
    st.tuples(st.just("start"), st.integers(0, len(BASES) - 1), st.lists(st.integers(3, 6), max_size=9),
              st.booleans()),
    st.tuples(st.just("continue"), st.integers(0, 50), st.lists(st.integers(3, 6), min_size=1, max_size=5)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("pressure"), st.integers(1, 12)),
    st.tuples(st.just("forget")),
), max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(4, 24))
def test_random_sequences_keep_the_books_and_never_touch_a_held_block(ops, num_blocks):
    m = Model(num_blocks)
    for op in ops:
        if op[0] == "start":
            _, base, suffix, register = op
            m.start(BASES[base] + suffix, register)
        elif op[0] == "continue":  # a later turn: an earlier sequence's tokens and a few more
            if m.started:
                m.start(m.started[op[1] % len(m.started)] + op[2], True)
        elif op[0] in ("finish", "abort"):  # the allocator sees both as a dropped hold
            m.end(op[1])
        elif op[0] == "forget":  # a prefix cache reset: held blocks stay held, nothing is found
            m.a.forget()
            assert m.a.num_cached == 0
            for tokens in m.started:
                names = block_hashes(tokens, BS, SALT)
                assert m.a.lookup(names) == []
                assert m.a.find_tail(names[-1] if names else SALT, tokens[len(names) * BS:])[1] == 0
        else:  # another request's blocks: evicts the least recently released cached blocks
            n = op[1]
            if n <= m.a.num_free:
                before, empty = m.a.num_evictions, m.a.num_empty
                fresh = m.a.allocate(n)
                assert m.a.num_evictions - before == max(0, n - empty)  # evicts only past the empty ones
                for b in fresh:
                    assert m.holders(b) == 0
                    m.content[b] = ("written by", m.next)
                m.seqs[m.next] = fresh
                m.next += 1
        m.check()
    while m.seqs:
        m.end(0)
    m.check()
    assert m.a.num_free == num_blocks and m.a.num_used == 0


def test_eviction_is_lru_and_only_when_empty_blocks_run_out():
    a = BlockAllocator(4, caching=True)
    names = block_hashes(list(range(12)), BS, SALT)
    x, y = a.allocate(1), a.allocate(1)
    a.register(x[0], names[0])
    a.register(y[0], names[1])
    a.free(x)
    a.free(y)  # released after x: evicted after x
    assert a.num_cached == 2 and a.num_empty == 2
    assert a.allocate(2) and a.num_evictions == 0  # the empty ones first
    assert a.allocate(1) == x and a.num_evictions == 1 and a.lookup(names[:1]) == []
    assert a.lookup(names[1:2]) == y


def test_a_referenced_block_is_never_evicted():
    a = BlockAllocator(2, caching=True)
    names = block_hashes(list(range(8)), BS, SALT)
    (b,) = a.allocate(1)
    a.register(b, names[0])
    a.free([b])
    a.acquire(a.lookup(names[:1]))  # a second request reuses it
    assert a.num_free == 1
    with pytest.raises(OutOfBlocks):
        a.allocate(2)
    assert a.allocate(1) != [b]
    a.check_integrity()


def test_caching_off_finds_nothing_and_frees_to_empty():
    a = BlockAllocator(2)
    names = block_hashes(list(range(8)), BS, SALT)
    (b,) = a.allocate(1)
    a.register(b, names[0])
    a.free([b])
    assert a.lookup(names) == [] and a.num_empty == 2 and a.num_cached == 0


def test_salt_separates_chains():
    tokens = list(range(16))
    assert block_hashes(tokens, BS, salt_of("m", "bf16")) != block_hashes(tokens, BS, salt_of("m", "fp8"))
    one, two = block_hashes(tokens, BS, SALT), block_hashes([99] + tokens[1:], BS, SALT)
    assert all(x != y for x, y in zip(one, two))  # a changed first token renames every later block


def test_digest_sees_the_lru_order_and_the_index():
    """Two allocators that differ only in which cached block is evicted next digest apart."""
    names = block_hashes(list(range(8)), BS, SALT)
    one, two = BlockAllocator(4, caching=True), BlockAllocator(4, caching=True)
    for a in (one, two):
        blocks = a.allocate(2)
        a.register(blocks[0], names[0])
        a.register(blocks[1], names[1])
    one.free([0, 1])
    two.free([1, 0])
    assert (one.num_free, one.num_used) == (two.num_free, two.num_used)
    assert one.digest() != two.digest()
