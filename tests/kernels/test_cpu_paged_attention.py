"""The native CPU paged decode attention (csrc/cpu/attention_avx2.cpp, and attention_avx512.cpp for
head_dim 64 and 128 with up to 8 query heads per KV head) against the torch reference.

Random caches and block tables (blocks shuffled, so a sequence's blocks are scattered and tables
are padded), odd context lengths on and off block boundaries, GQA ratios 1, 3 and 8, head sizes
that are and are not a multiple of the SIMD width, and queries that are a strided view (as the
model passes them: the q heads of the fused qkv projection).

Bound, and why: both sides compute in fp32 from the same inputs. A score differs by the
rounding of a head_dim-term dot product, at most about head_dim * 2^-24 * sum|q_i k_i| * scale
(≈ 4e-6 relative for head_dim 128); the softmax weights then differ by that much relative, and
each output is a convex combination of value rows, so |Δout| <= (|Δscore| * 2 + context * 2^-24)
* max|v|. With |q|, |k|, |v| ~ N(0, 1), head_dim <= 128 and contexts <= 300 that is < 1e-4;
we allow atol 2e-4, rtol 1e-4 (observed: ≤ 3e-6). Contexts over 1,024 keys are computed in
parts and merged (a few more roundings: one exp and one product per part); the worst case grows
with the context (≈ 6e-4 at 2,600) but rounding errors do not line up: observed ≤ 4e-7 there.
"""
from __future__ import annotations

import pytest
import torch

from pdserve_kernels import attention, attention_cpu, cpu_lib



def random_paged_cache(lens: list[int], kv_heads: int, head_dim: int, block_size: int, g: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and shuffled block tables for contexts of `lens` tokens; each table row
    padded with block 0, as the model runner pads them. Also used by test_cpu_extend_attention."""
    per_seq = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(per_seq) + 2, dtype=torch.long)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[used:used + n]
        used += n
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    return k_cache, v_cache, tables


def _case(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = random_paged_cache(lens, kv_heads, head_dim, block_size, g)
    # q heads are a view into a wider row, like the q part of the fused qkv projection
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, generator=g)
    return qkv[:, :heads], k_cache, v_cache, tables


CASES = [  # (context lengths, heads, kv_heads, head_dim, block_size)
    ([1], 9, 3, 64, 16),
    ([16, 17, 15, 33], 9, 3, 64, 16),       # on, after and before block boundaries
    ([300, 1, 77], 8, 1, 128, 16),           # GQA 8:1, head_dim 128, long and single-token contexts
    ([5, 40, 64, 65, 129], 4, 4, 40, 32),    # no GQA, head_dim not a multiple of 8 or 16
    ([50, 3], 6, 2, 24, 7),                  # odd block size, chunks cut by block ends
    ([200], 12, 4, 64, 256),                 # one block longer than a chunk of keys
    ([2600, 1025, 1024, 2049], 9, 3, 64, 16),  # split in parts of 1,024 keys, merged (attention.h)
    ([2200, 600], 8, 1, 128, 32),              # GQA 8:1 over parts
    ([1400, 90], 6, 2, 24, 7),                 # parts that start inside a block, the generic path
]


ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not cpu_lib.isa_supported(isa), reason=f"no {isa} here"))
        for isa in ("avx2", "avx512")]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("lens,heads,kv_heads,head_dim,block_size", CASES)
def test_native_decode_attention_equals_the_torch_reference(lens, heads, kv_heads, head_dim, block_size, isa):
    q, k_cache, v_cache, tables = _case(lens, heads, kv_heads, head_dim, block_size, seed=sum(lens))
    starts = list(range(len(lens) + 1))
    scale = head_dim ** -0.5
    want = attention.paged_attention(q, k_cache, v_cache, starts, lens, tables, scale)
    got = cpu_lib.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), scale, isa=isa)
    assert got.shape == want.shape == (len(lens), heads, head_dim)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_the_op_takes_the_native_kernel():
    q, k_cache, v_cache, tables = _case([16, 17, 15, 33], 9, 3, 64, 16, seed=1)
    lens = [16, 17, 15, 33]
    got = attention_cpu.paged_attention_cpu(q, k_cache, v_cache, list(range(5)), lens, tables, 0.125)
    assert torch.equal(got, cpu_lib.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), 0.125))


def test_threads_split_sequences_and_kv_heads_without_changing_the_result():
    lens = [70, 9, 2600]  # the long one in parts of 1,024 keys, on either thread, merged in one order
    q, k_cache, v_cache, tables = _case(lens, 9, 3, 64, 16, seed=7)
    one = cpu_lib.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), 0.125, threads=1)
    two = cpu_lib.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), 0.125, threads=2)
    assert torch.equal(one, two)


@pytest.mark.parametrize("isa", ISAS)
def test_a_long_rows_parts_do_not_depend_on_its_batch(isa):
    """The split of a row's keys follows from its own context: alone or among other rows (with
    parts of their own or not), its result is the same bits."""
    lens = [2600, 40, 4097, 1024, 1025]
    q, k_cache, v_cache, tables = _case(lens, 9, 3, 64, 16, seed=11)
    batch = cpu_lib.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), 0.125, isa=isa)
    for b, n in enumerate(lens):
        alone = cpu_lib.paged_decode_attention(q[b:b + 1], k_cache, v_cache, tables[b:b + 1], torch.tensor([n]),
                                               0.125, isa=isa)
        assert torch.equal(batch[b:b + 1], alone), n


def test_other_dtypes_run_the_reference():
    # (prefill chunks take the extend kernel: tests/kernels/test_cpu_extend_attention.py)
    q, k_cache, v_cache, tables = _case([20, 7], 4, 2, 16, 16, seed=3)
    qb, kb, vb = q.to(torch.bfloat16), k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    got = attention_cpu.paged_attention_cpu(qb, kb, vb, [0, 1, 2], [20, 7], tables, 0.25)
    assert torch.equal(got, attention.paged_attention(qb, kb, vb, [0, 1, 2], [20, 7], tables, 0.25))


def test_bad_arguments_are_a_clear_error():
    q, k_cache, v_cache, tables = _case([4], 4, 2, 16, 16, seed=1)
    with pytest.raises(RuntimeError, match="bad arguments"):
        cpu_lib.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([0]), 0.25)
    with pytest.raises(ValueError, match="int64 block tables"):
        cpu_lib.paged_decode_attention(q, k_cache, v_cache, tables.int(), torch.tensor([4]), 0.25)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("lens,heads,kv_heads,head_dim,block_size", [c for c in CASES if c[3] % 16 == 0])
def test_an_fp16_cache_is_read_as_its_exact_fp32_values(lens, heads, kv_heads, head_dim, block_size, isa):
    """--kv-cache-dtype float16: the kernels widen each element exactly, so the bound above holds
    against the reference reading the same fp16 cache."""
    q, k_cache, v_cache, tables = _case(lens, heads, kv_heads, head_dim, block_size, seed=sum(lens) + 1)
    k16, v16 = k_cache.half(), v_cache.half()
    starts = list(range(len(lens) + 1))
    scale = head_dim ** -0.5
    want = attention.paged_attention(q, k16, v16, starts, lens, tables, scale)
    got = cpu_lib.paged_decode_attention(q, k16, v16, tables, torch.tensor(lens), scale, isa=isa)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_the_op_takes_the_native_kernel_for_an_fp16_cache():
    q, k_cache, v_cache, tables = _case([16, 17, 15, 33], 9, 3, 64, 16, seed=2)
    k16, v16, lens = k_cache.half(), v_cache.half(), [16, 17, 15, 33]
    got = attention_cpu.paged_attention_cpu(q, k16, v16, list(range(5)), lens, tables, 0.125)
    assert torch.equal(got, cpu_lib.paged_decode_attention(q, k16, v16, tables, torch.tensor(lens), 0.125))


def test_an_fp16_cache_of_other_head_sizes_runs_the_reference():
    q, k_cache, v_cache, tables = _case([20, 7], 4, 2, 24, 16, seed=4)  # 24: not a multiple of 16
    k16, v16 = k_cache.half(), v_cache.half()
    assert cpu_lib.cache_is_half(k16, v16) is None
    got = attention_cpu.paged_attention_cpu(q, k16, v16, [0, 1, 2], [20, 7], tables, 0.25)
    assert torch.equal(got, attention.paged_attention(q, k16, v16, [0, 1, 2], [20, 7], tables, 0.25))
    with pytest.raises(ValueError, match="fp16 caches"):
        cpu_lib.paged_decode_attention(q, k16, v16, tables, torch.tensor([20, 7]), 0.25)
