"""The CUDA paged attention's per-step inputs (built once per step, on any device) and, on a GPU,
its decode across the layers of a step against the torch reference."""
from __future__ import annotations

import pytest
import torch

from pdserve_kernels import attention, attention_cuda, cuda_lib
from pdserve_kernels.attention import gather_kv


def test_a_steps_decode_inputs_are_built_once_and_never_reused_by_the_next_step():
    tables = torch.tensor([[3, 1, 0], [2, 5, 4]])
    lens = [40, 17]
    first = attention_cuda.decode_inputs(tables, lens, 2, 4)
    assert first.tables.dtype == first.lens.dtype == torch.int32
    assert first.tables.is_contiguous() and first.tables.tolist() == tables.tolist()
    assert first.lens.tolist() == lens
    assert first.splits == cuda_lib.default_decode_splits(2, 2, 4, 40, 1)
    again = attention_cuda.decode_inputs(tables, lens, 2, 4)  # the next layer of the step
    assert again.tables is first.tables and again.lens is first.lens
    # another layer shape in the same step shares the tensors, with its own split count
    other = attention_cuda.decode_inputs(tables, lens, 1, 16)
    assert other.tables is first.tables and other.splits == cuda_lib.default_decode_splits(2, 1, 16, 40, 1)
    # the next step: a new tables tensor (equal values) and one sequence a token longer
    later = attention_cuda.decode_inputs(tables.clone(), [41, 17], 2, 4)
    assert later.lens is not first.lens and later.lens.tolist() == [41, 17]


def test_a_graphs_static_inputs_serve_every_layer_of_its_step():
    tables, lens = torch.zeros(2, 3, dtype=torch.int32), [50, 50]
    static_lens = torch.tensor([7, 9], dtype=torch.int32)
    attention_cuda.use_decode_inputs(tables, lens, tables, static_lens)
    got = attention_cuda.decode_inputs(tables, lens, 2, 4)
    assert got.tables is tables and got.lens is static_lens
    assert got.splits == cuda_lib.default_decode_splits(2, 2, 4, 50, 1)  # sized by the lengths given


def test_a_steps_prefill_slots_gather_each_sequences_context_in_order():
    torch.manual_seed(0)
    bs, lens, q_starts = 4, [9, 1, 14], [0, 3, 4, 9]  # chunks of 3, 1 and 5 new tokens
    cache = torch.randn(12, bs, 2, 8)
    tables = torch.tensor([[7, 2, 9, 0], [5, 0, 0, 0], [1, 11, 3, 8]])
    step = attention_cuda.prefill_inputs(tables, q_starts, lens, bs)
    want = torch.cat([gather_kv(cache, tables[i], n) for i, n in enumerate(lens)])
    assert torch.equal(cache.flatten(0, 1).index_select(0, step.slots), want)
    assert step.cu_q.tolist() == q_starts and step.cu_k.tolist() == [0, 9, 10, 24] and step.max_q == 5
    assert step.cu_q.dtype == step.cu_k.dtype == torch.int32
    assert attention_cuda.prefill_inputs(tables, q_starts, lens, bs) is step  # the step's next layer
    assert attention_cuda.prefill_inputs(tables.clone(), q_starts, lens, bs) is not step  # the next step


@pytest.mark.skipif(not cuda_lib.available(), reason="needs a CUDA device and the kernels (make kernels)")
def test_paged_decode_on_cuda_matches_the_reference_layer_after_layer():
    torch.manual_seed(0)
    dev, d, hq, hkv, bs = "cuda", 128, 8, 2, 16
    lens = [1, 33, 300]
    tables = torch.randperm(64, device=dev)[:3 * 19].reshape(3, 19)  # 19 blocks hold 300 tokens
    for layer in range(3):  # one step: the same tables and lengths, each layer its own cache
        k_cache = torch.randn(64, bs, hkv, d, device=dev, dtype=torch.bfloat16)
        v_cache = torch.randn(64, bs, hkv, d, device=dev, dtype=torch.bfloat16)
        q = torch.randn(3, hq, d, device=dev, dtype=torch.bfloat16)
        got = attention_cuda.paged_attention_cuda(q, k_cache, v_cache, [0, 1, 2, 3], lens, tables, d ** -0.5)
        want = attention.paged_attention(q.float(), k_cache.float(), v_cache.float(), [0, 1, 2, 3], lens,
                                         tables, d ** -0.5)
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 2e-2, (layer, err.item())


@pytest.mark.skipif(not cuda_lib.available(), reason="needs a CUDA device and the kernels (make kernels)")
def test_paged_prefill_on_cuda_matches_the_reference_layer_after_layer():
    torch.manual_seed(0)
    dev, d, hq, hkv, bs = "cuda", 64, 6, 2, 16
    lens, q_starts = [40, 7, 70], [0, 8, 15, 35]  # chunks after cached prefixes, and a whole prompt
    tables = torch.randperm(64, device=dev)[:3 * 5].reshape(3, 5)
    for layer in range(3):  # one step: the same tables and lengths, each layer its own cache
        k_cache = torch.randn(64, bs, hkv, d, device=dev, dtype=torch.bfloat16)
        v_cache = torch.randn(64, bs, hkv, d, device=dev, dtype=torch.bfloat16)
        q = torch.randn(35, hq, d, device=dev, dtype=torch.bfloat16)
        got = attention_cuda.paged_attention_cuda(q, k_cache, v_cache, q_starts, lens, tables, d ** -0.5)
        want = attention.paged_attention(q.float(), k_cache.float(), v_cache.float(), q_starts, lens, tables,
                                         d ** -0.5)
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 2e-2, (layer, err.item())
