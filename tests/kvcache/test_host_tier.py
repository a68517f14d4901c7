"""The host-memory tier: random request sequences over a tiny device pool with a host tier
keep both tiers' books exact, and every block a request reuses — held on the device, or loaded
back from host memory — holds exactly the bytes written for its name (real tensors move)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kvcache import BlockAllocator, CacheTensorSpec, HostTier, KVPool, block_hashes, salt_of

BS = 2
SALT = salt_of("host-tier-test")
BASES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [7] * 10, []]


def value(name: bytes) -> float:
    return float(int.from_bytes(name[:2], "little"))


class Model:
    def __init__(self, device_blocks: int, host_blocks: int):
        self.pool = KVPool([[CacheTensorSpec("k", (2,), torch.float32)]], device_blocks, BS)
        self.a = BlockAllocator(device_blocks, caching=True, host=HostTier(self.pool, host_blocks))
        self.seqs: list[list[int]] = []

    def start(self, tokens: list[int]) -> None:
        a = self.a
        names = block_hashes(tokens, BS, SALT)
        usable = (len(tokens) - 1) // BS if tokens else 0
        hit = a.lookup(names[:usable])
        rest = names[len(hit):usable]
        rest = rest[:a.host_chain(rest)]
        need = -(-len(tokens) // BS) - len(hit)  # the host copies need device blocks too
        if need + sum(1 for b in hit if a.refcount(b) == 0) > a.num_free:
            return
        a.acquire(hit)
        loaded = a.load(rest) if rest else []
        table = hit + loaded
        k = self.pool.layers[0]["k"]
        for b, name in zip(table, names):  # every reused block holds its name's bytes
            assert torch.all(k[b] == value(name)), "a reused block holds other bytes"
        fresh = a.allocate(need - len(loaded))
        for i, b in enumerate(fresh, start=len(table)):  # "the forward" writes the new blocks
            k[b] = value(names[i]) if i < len(names) else -1.0
            if i < len(names):
                a.register(b, names[i])
        self.seqs.append(table + fresh)

    def end(self, i: int) -> None:
        if self.seqs:
            self.a.free(self.seqs.pop(i % len(self.seqs)))

    def check(self) -> None:
        self.a.check_integrity()
        held = {b for t in self.seqs for b in t}
        assert self.a.num_used == len(held)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("start"), st.integers(0, 3), st.lists(st.integers(3, 5), max_size=6)),
    st.tuples(st.just("end"), st.integers(0, 20)), st.tuples(st.just("forget"))), max_size=80),
    st.integers(6, 14), st.integers(1, 12))
def test_both_tiers_keep_their_books_and_their_bytes(ops, device_blocks, host_blocks):
    m = Model(device_blocks, host_blocks)
    for op in ops:
        if op[0] == "start":
            m.start(BASES[op[1]] + op[2])
        elif op[0] == "forget":  # a prefix cache reset drops the host copies too
            m.a.forget()
            assert m.a.num_cached == m.a.host.num_cached == 0
        else:
            m.end(op[1])
        m.check()
    while m.seqs:
        m.end(0)
    m.check()
    assert m.a.num_free == device_blocks


def test_an_evicted_block_comes_back_from_host_memory():
    m = Model(device_blocks=4, host_blocks=8)
    m.start([1, 2, 3, 4, 5])       # 3 blocks, 2 of them full and named
    m.end(0)
    m.start([50, 51, 52, 53, 54, 55, 56])  # 4 blocks: evicts both named blocks (saved to host)
    assert m.a.lookup(block_hashes([1, 2, 3, 4], BS, SALT)) == [] and m.a.host.num_saved == 2
    m.end(0)
    m.start([1, 2, 3, 4, 5])       # loads both back (the bytes are checked in start)
    assert m.a.host.num_loaded == 2
    m.check()
