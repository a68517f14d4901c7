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


def _sharing_case(groups: list[tuple[int, list[int]]], heads: int, kv_heads: int, head_dim: int, block_size: int,
                  seed: int):
    """Rows that share their first blocks, as sequences that hit one cached prefix do: per group,
    (blocks its rows share, each row's context length); each row's other blocks are its own."""
    g = torch.Generator().manual_seed(seed)
    lens = [n for _, ns in groups for n in ns]
    need = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(shared for shared, _ in groups) + sum(need) + 3
    order = iter(torch.randperm(num_blocks, generator=g).tolist())
    tables = torch.zeros(len(lens), max(need) + 2, dtype=torch.long)
    row = 0
    for shared, ns in groups:
        common = [next(order) for _ in range(shared)]
        for n in ns:
            blocks = (common + [next(order) for _ in range(max(0, need[row] - shared))])[:need[row]]
            tables[row, :len(blocks)] = torch.tensor(blocks)
            row += 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, generator=g)[:, :heads]
    return q, k_cache, v_cache, tables, lens


SHARING = [  # (groups: (shared blocks, context lengths)), heads, kv_heads, head_dim, block_size
    ([(80, [1350, 1350, 1400, 1290]), (0, [700])], 9, 3, 64, 16),     # agent sessions over one prompt
    ([(130, [2600, 3000, 2100, 1100, 2081]), (3, [60, 900])], 9, 3, 64, 16),  # the shared keys span parts
    ([(40, [700] * 11)], 8, 1, 128, 16),                                # more rows than one unit takes
    ([(10, [500, 520, 330]), (12, [400, 640])], 12, 4, 64, 32),         # two prompts, blocks of 32
    ([(300, [2100, 2400, 3100])], 6, 2, 64, 7),                          # parts that start inside a block
    ([(3, [40, 300, 80])], 4, 4, 64, 16),                               # too few shared keys to share a unit
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("groups,heads,kv_heads,head_dim,block_size", SHARING)
def test_rows_that_share_a_prefix_get_the_bits_they_get_alone(groups, heads, kv_heads, head_dim, block_size, half,
                                                              isa):
    """Rows whose first blocks are the same share a unit of work over those keys (each chunk loaded
    once for all of them, decode_split.h) on AVX-512; every row still does its own arithmetic in
    its own order, so it gets the bits it gets alone, on 1 or 2 threads, in a decode or a mixed
    batch, and within the reference's bound."""
    q, k_cache, v_cache, tables, lens = _sharing_case(groups, heads, kv_heads, head_dim, block_size, seed=heads)
    if half:
        k_cache, v_cache = k_cache.half(), v_cache.half()
    scale, n = head_dim ** -0.5, torch.tensor(lens)
    alone = torch.cat([cpu_lib.paged_decode_attention(q[b:b + 1], k_cache, v_cache, tables[b:b + 1], n[b:b + 1], scale,
                                                      isa=isa, threads=1) for b in range(len(lens))])
    for threads in (1, 2):
        batch = cpu_lib.paged_decode_attention(q, k_cache, v_cache, tables, n, scale, isa=isa, threads=threads)
        assert torch.equal(batch, alone)
    # the same rows as the decode tokens of a mixed step, after a prompt chunk of 5 tokens over 30
    prompt_q = torch.randn(5, heads, head_dim, generator=torch.Generator().manual_seed(1))
    prompt_table = torch.zeros(1, tables.shape[1], dtype=torch.long)
    prompt_table[0, :3] = tables[0, :3]
    mixed = cpu_lib.paged_extend_attention(torch.cat([prompt_q, q]), k_cache, v_cache, torch.cat([prompt_table, tables]),
                                           torch.tensor([30] + lens), torch.tensor([0, 5] + [6 + b for b in range(len(lens))]),
                                           scale, isa=isa, threads=2)
    assert torch.equal(mixed[5:], alone)
    want = attention.paged_attention(q, k_cache, v_cache, list(range(len(lens) + 1)), lens, tables, scale)
    torch.testing.assert_close(alone, want, atol=2e-4, rtol=1e-4)


@pytest.mark.skipif(not cpu_lib.isa_supported("avx512"), reason="no avx512 here")
def test_rows_that_share_blocks_share_units_on_avx512():
    """The plan behind the test above: which rows share a unit, over which keys."""
    groups = [(80, [1350, 1350, 1400, 1290]), (0, [700])]  # 80 blocks of 16: 1,280 keys
    _, _, _, tables, lens = _sharing_case(groups, 9, 3, 64, 16, seed=0)
    units = cpu_lib.decode_units(tables, torch.tensor(lens), 9, 3, 64, 16, isa="avx512", threads=2)
    # the four rows: one unit per KV head and part of their 1,280 shared keys (1,024 + 256); the
    # second part's goes on over each row's own keys, so those rows have no unit of their own
    assert sorted(u for u in units if u[0] > 1) == sorted((4, h, p, end) for h in range(3)
                                                          for p, end in ((0, 1024), (1, 1280)))
    assert sorted(u for u in units if u[0] == 1) == [(1, h, 0, 0) for h in range(3)]  # the fifth row's
    # on 16 threads, sharing would leave threads idle: every unit is one row's
    units = cpu_lib.decode_units(tables, torch.tensor(lens), 9, 3, 64, 16, isa="avx512", threads=16)
    assert len(units) == 5 * 3 + 4 * 3 and all(u[0] == 1 for u in units)  # two parts for the four
    # 11 rows: at most kSharedRowsMax (8) in a unit, and about two units per thread
    _, _, _, tables, lens = _sharing_case([(40, [700] * 11)], 8, 1, 128, 16, seed=0)
    one = cpu_lib.decode_units(tables, torch.tensor(lens), 8, 1, 128, 16, isa="avx512", threads=1)
    assert sorted(one) == [(5, 0, 0, 640), (6, 0, 0, 640)]
    two = cpu_lib.decode_units(tables, torch.tensor(lens), 8, 1, 128, 16, isa="avx512", threads=2)
    assert sorted(two) == [(2, 0, 0, 640), (3, 0, 0, 640), (3, 0, 0, 640), (3, 0, 0, 640)]
    # fewer shared keys than kSharedKeysMin (64; here 3 blocks, 48 keys): every unit is one row's
    _, _, _, tables, lens = _sharing_case([(3, [60, 900])], 9, 3, 64, 16, seed=0)
    assert all(u[0] == 1 for u in cpu_lib.decode_units(tables, torch.tensor(lens), 9, 3, 64, 16, isa="avx512"))
    # AVX2 never shares a unit (measured: no faster there, docs/cpu-attention.md)
    _, _, _, tables, lens = _sharing_case(groups, 9, 3, 64, 16, seed=0)
    assert all(u[0] == 1 for u in cpu_lib.decode_units(tables, torch.tensor(lens), 9, 3, 64, 16, isa="avx2"))
