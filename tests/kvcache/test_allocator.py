"""The allocator never leaks: free + used == total after any sequence of operations."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvcache import BlockAllocator, OutOfBlocks


@given(st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 12)), max_size=200))
def test_allocator_books_balance(ops):
    alloc = BlockAllocator(32)
    held: list[list[int]] = []
    for op, n in ops:
        if op == "alloc":
            before = alloc.num_free
            try:
                held.append(alloc.allocate(n))
            except OutOfBlocks:
                assert n > before and alloc.num_free == before  # nothing taken on failure
        elif held:
            alloc.free(held.pop(n % len(held)))
        alloc.check_integrity()
        assert alloc.num_free + alloc.num_used == 32
    for blocks in held:
        alloc.free(blocks)
    assert alloc.num_free == 32


def test_double_free_is_refused():
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(2)
    alloc.free(blocks)
    with pytest.raises(ValueError):
        alloc.free(blocks)
    alloc.check_integrity()


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    # 24 blocks of 4 tokens: small enough that the runs below preempt
    return LLMEngine(EngineConfig(model=tiny_llama_dir, block_size=4, kv_cache_memory=24 * 4 * 2 * 2 * 2 * 16 * 4,
                                  max_num_batched_tokens=24, max_num_seqs=8))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step"]), st.integers(0, 50),
                          st.integers(1, 30), st.integers(-1, 2)), max_size=60))
def test_engine_run_returns_every_block(engine, ops):
    """Random adds (append happens by decoding) of mixed priorities (which preempt each other),
    aborts at any moment, steps; the pool ends full."""
    assert engine.pool.num_blocks == 24
    ids = 0
    for op, a, b, priority in ops:
        if op == "add":
            engine.add_request(f"r{ids}", [3 + (a + i) % 250 for i in range(b)],
                               SamplingParams(temperature=0, max_tokens=1 + a % 9, ignore_eos=True,
                                              priority=priority))
            ids += 1
        elif op == "abort" and ids:
            engine.abort(f"r{a % ids}")
        else:
            engine.step()
        engine.allocator.check_integrity()
        # requests with a common prefix share its cached blocks: count each block once
        used = {b for s in engine.scheduler.seqs.values() for b in s.block_table}
        assert len(used) == engine.allocator.num_used
    engine.run_until_done()
    engine.allocator.check_integrity()
    assert engine.allocator.num_free == engine.pool.num_blocks
    assert not engine.scheduler.seqs
