"""The native CPU extend attention (csrc/cpu/extend_attention_*.cpp: several new tokens per
sequence over a cached prefix, causal) against the torch reference.

Random caches, block tables shuffled and padded, batches that mix sequences with one new token,
many new tokens, and no cached prefix; contexts on and around block boundaries; GQA 1:1, 3:1 and
8:1; head sizes 64, 128 and ones that are not a multiple of the value tile (36, 20); block sizes
7, 16 and 32; queries that are a strided view of the fused qkv output (as the model passes them).
Sequences with one new token take the decode kernel inside the same call (bit for bit).

Bound, and why (as for decode, docs/cpu-attention.md): both sides compute in fp32 from the same
inputs and differ only in the order of the sums, where the scale is applied and the exp. A score
differs by about head_dim * 2^-24 * sum|q_i k_i| * scale; the softmax weights then differ by that
much relative, and each output is a convex combination of value rows, so
|Δout| <= (2 |Δscore| + context * 2^-24) * max|v|. With N(0, 1) data, head_dim <= 128 and
contexts <= 400 that is < 1e-4: atol 2e-4, rtol 1e-4 (observed: ≤ 2e-6).
"""
from __future__ import annotations

import pytest
import torch

from pdserve_kernels import attention, attention_cpu, cpu_lib

from tests.kernels.test_cpu_paged_attention import random_paged_cache


def _case(new: list[int], cached: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
          seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(cached, new)]
    k_cache, v_cache, tables = random_paged_cache(lens, kv_heads, head_dim, block_size, g)
    qkv = torch.randn(sum(new), heads + 2 * kv_heads, head_dim, generator=g)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    return qkv[:, :heads], k_cache, v_cache, tables, lens, starts


CASES = [  # (new tokens, cached tokens, heads, kv_heads, head_dim, block_size)
    ([64, 64], [300, 260], 9, 3, 64, 16),            # the agent multi-turn shape, smaller
    ([1, 40, 7, 1], [30, 0, 16, 100], 9, 3, 64, 16),  # mixed: decode tokens, a prompt, an extend
    ([16, 17, 15], [16, 15, 33], 8, 1, 128, 16),      # GQA 8:1, contexts around block ends
    ([33, 2], [64, 1], 4, 4, 36, 32),                 # no GQA, head_dim not a multiple of 8
    ([50, 9], [3, 0], 6, 2, 20, 7),                   # odd block size, chunks across many blocks
    ([130], [0], 9, 3, 64, 16),                       # a first prompt: more than two tiles
]


@pytest.mark.parametrize("new,cached,heads,kv_heads,head_dim,block_size", CASES)
def test_native_extend_attention_equals_the_torch_reference(new, cached, heads, kv_heads, head_dim, block_size):
    q, k_cache, v_cache, tables, lens, starts = _case(new, cached, heads, kv_heads, head_dim, block_size,
                                                      seed=sum(new) + sum(cached))
    scale = head_dim ** -0.5
    want = attention.paged_attention(q, k_cache, v_cache, starts, lens, tables, scale)
    got = attention_cpu.paged_attention_cpu(q, k_cache, v_cache, starts, lens, tables, scale)
    assert got.shape == want.shape == (sum(new), heads, head_dim)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_each_instruction_set_matches_the_reference_and_ignores_the_thread_count(isa):
    if not cpu_lib.isa_supported(isa):
        pytest.skip(f"this CPU lacks {isa}")
    q, k_cache, v_cache, tables, lens, starts = _case([70, 1, 25], [90, 40, 0], 9, 3, 64, 16, seed=5)
    want = attention.paged_attention(q, k_cache, v_cache, starts, lens, tables, 0.125)
    lens_t, starts_t = torch.tensor(lens), torch.tensor(starts)
    one = cpu_lib.paged_extend_attention(q, k_cache, v_cache, tables, lens_t, starts_t, 0.125, isa=isa, threads=1)
    two = cpu_lib.paged_extend_attention(q, k_cache, v_cache, tables, lens_t, starts_t, 0.125, isa=isa, threads=2)
    torch.testing.assert_close(one, want, atol=2e-4, rtol=1e-4)
    assert torch.equal(one, two)  # each (sequence, KV head, tile) is one thread's, summed in one order


def test_more_new_tokens_than_context_is_a_clear_error():
    q, k_cache, v_cache, tables, lens, starts = _case([5], [0], 4, 2, 16, 16, seed=1)
    with pytest.raises(RuntimeError, match="bad arguments"):
        cpu_lib.paged_extend_attention(q, k_cache, v_cache, tables, torch.tensor([4]), torch.tensor(starts), 0.25)
    with pytest.raises(ValueError, match="starts"):
        cpu_lib.paged_extend_attention(q, k_cache, v_cache, tables, torch.tensor(lens), torch.tensor([0, 4]), 0.25)


@pytest.mark.parametrize("cached", [[40, 20, 77], [2600, 20, 1500]])  # short rows, and rows in parts
def test_a_decode_token_among_prefill_chunks_gets_the_decode_kernels_result(cached):
    q, k_cache, v_cache, tables, lens, starts = _case([1, 30, 1], cached, 9, 3, 64, 16, seed=9)
    mixed = attention_cpu.paged_attention_cpu(q, k_cache, v_cache, starts, lens, tables, 0.125)
    decode_rows = [0, 31]
    alone = cpu_lib.paged_decode_attention(q[decode_rows], k_cache, v_cache, tables[[0, 2]],
                                           torch.tensor([lens[0], lens[2]]), 0.125)
    assert torch.equal(mixed[decode_rows], alone)  # the same arithmetic, whatever shares the step


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("new,cached,heads,kv_heads,head_dim,block_size", [c for c in CASES if c[4] % 16 == 0])
def test_an_fp16_cache_is_read_as_its_exact_fp32_values(isa, new, cached, heads, kv_heads, head_dim, block_size):
    """--kv-cache-dtype float16: each chunk's K/V rows are widened exactly, so the fp32 bound
    holds against the reference reading the same fp16 cache, and threads do not change a bit."""
    if not cpu_lib.isa_supported(isa):
        pytest.skip(f"this CPU lacks {isa}")
    q, k_cache, v_cache, tables, lens, starts = _case(new, cached, heads, kv_heads, head_dim, block_size,
                                                      seed=sum(new) + sum(cached) + 1)
    k16, v16 = k_cache.half(), v_cache.half()
    scale = head_dim ** -0.5
    want = attention.paged_attention(q, k16, v16, starts, lens, tables, scale)
    lens_t, starts_t = torch.tensor(lens), torch.tensor(starts)
    one = cpu_lib.paged_extend_attention(q, k16, v16, tables, lens_t, starts_t, scale, isa=isa, threads=1)
    two = cpu_lib.paged_extend_attention(q, k16, v16, tables, lens_t, starts_t, scale, isa=isa, threads=2)
    torch.testing.assert_close(one, want, atol=2e-4, rtol=1e-4)
    assert torch.equal(one, two)
