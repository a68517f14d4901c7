"""The fused blocks of a decoder layer (csrc/cpu/layer_block.cpp: one native call for the
attention half, one for the MLP half) against their torch references (pdserve_kernels.
layer_blocks), which compose the reference ops: rms_norm, dequantize-then-matmul, rotate-half
RoPE, store_kv and paged attention.

Random weights in each block format, scattered and padded block tables, contexts on and off block
boundaries, GQA, a head size that is not a multiple of the SIMD width (24), hidden sizes of a few
blocks, the first layer's call (no residual) and a later one, on each instruction set; decode
batches (one new token a sequence) and extend batches (prompt chunks over a cached prefix, a whole
prompt, decode rows among them).

Bound, and why: both sides compute in fp32 from the same inputs and differ only in summation
order and in the exp polynomial (≈2e-7 relative). A matmul output's error is at most about
K · 2⁻²⁴ · Σ|terms| (K ≤ 192 here: ≈1e-5 relative to Σ|terms|); the norm, RoPE and SwiGLU add a
few ulps; attention outputs are convex combinations of value rows, so score errors of that size
move them by about as much. The o/down projections then sum ≤ 192 such terms. 1e-4 of the
output's scale (its largest magnitude) leaves a 10× margin; the residual stream, RoPE'd keys
and values written to the cache are elementwise fp32 and compared with 1e-5.
"""
from __future__ import annotations

import pytest
import torch

from pdserve_kernels import cpu_lib, layer_blocks
from pdserve_kernels.quant import Q4_0, Q4_1, Q8_0, pack_q4, quantize

ISAS = [isa for isa in ("avx2", "avx512") if cpu_lib.isa_supported(isa)]


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * float(expected.abs().max()))


def _tables(lens: list[int], block_size: int, g: torch.Generator, new: list[int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Scattered, padded block tables for contexts `lens`, and the cache slots of each sequence's
    last `new[b]` tokens (default one), in order."""
    per_seq = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(per_seq) + 2
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(per_seq) + 1, dtype=torch.long)  # padded, as the runner does
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[used:used + n]
        used += n
    new = new or [1] * len(lens)
    slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size
                          for i, n in enumerate(lens) for p in range(n - new[i], n)])
    return tables, slots, num_blocks



def _block_inputs(g: torch.Generator, lens: list[int], new: list[int] | None, hidden: int, heads: int,
                  kv_heads: int, head_dim: int, fmts, block_size: int = 16):
    """Random inputs of an attention block over `lens` contexts (`new` tokens each; None: one):
    tables, slots, the block count, starts, x, residual, norm weight, quantized qkv and o weights,
    and the step's RoPE angles."""
    tables, slots, num_blocks = _tables(lens, block_size, g, new)
    M = len(slots)
    starts = None if new is None else torch.tensor([0, *new]).cumsum(0)
    x = torch.randn(M, hidden, generator=g)
    residual = torch.randn(M, hidden, generator=g)
    norm_w = torch.rand(hidden, generator=g) + 0.5
    qkv_w = quantize(torch.randn((heads + 2 * kv_heads) * head_dim, hidden, generator=g) * 0.1, fmts[0])
    o_w = quantize(torch.randn(hidden, heads * head_dim, generator=g) * 0.1, fmts[1])
    angles = torch.rand(M, head_dim // 2, generator=g) * 6.28
    return tables, slots, num_blocks, starts, x, residual, norm_w, qkv_w, o_w, angles

@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("lens,new,hidden,heads,kv_heads,head_dim,fmts,first", [
    ([1], None, 96, 3, 1, 32, (Q4_1, Q4_1), True),
    ([17, 40, 5], None, 64, 4, 2, 24, (Q8_0, Q4_0), False),
    ([33, 16], None, 128, 2, 2, 64, (Q4_0, Q8_0), False),
    ([21], [21], 96, 3, 1, 32, (Q4_1, Q4_1), True),                # a whole prompt
    ([70, 9, 40], [23, 1, 40], 64, 4, 2, 24, (Q8_0, Q4_0), False),  # over a cached prefix, a decode row
    ([50, 16], [1, 1], 128, 2, 2, 64, (Q4_0, Q8_0), False),         # decode rows, starts given
])
def test_attention_block_equals_reference(isa, lens, new, hidden, heads, kv_heads, head_dim, fmts, first):
    g = torch.Generator().manual_seed(len(lens) * hidden + sum(new or []))
    B, block_size = len(lens), 16
    tables, slots, num_blocks = _tables(lens, block_size, g, new)
    M = len(slots)
    starts = None if new is None else torch.tensor([0, *new]).cumsum(0)
    x = torch.randn(M, hidden, generator=g)
    residual = None if first else torch.randn(M, hidden, generator=g)
    norm_w = torch.rand(hidden, generator=g) + 0.5
    qkv_w = quantize(torch.randn((heads + 2 * kv_heads) * head_dim, hidden, generator=g) * 0.1, fmts[0])
    o_w = quantize(torch.randn(hidden, heads * head_dim, generator=g) * 0.1, fmts[1])
    angles = torch.rand(M, head_dim // 2, generator=g) * 6.28
    cos, sin = angles.cos(), angles.sin()
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    lens_t = torch.tensor(lens)
    args = (0.1 if first else 1e-5, qkv_w, fmts[0], o_w, fmts[1], cos, sin)
    x_ref, kc_ref, vc_ref = x.clone(), k_cache.clone(), v_cache.clone()
    ref = layer_blocks.attention_block(x_ref, residual, norm_w, *args, kc_ref, vc_ref, slots, tables,
                                       lens_t, starts, heads, kv_heads, head_dim ** -0.5)
    out = torch.empty(M, hidden)
    cpu_lib.attention_block(x, residual, norm_w, args[0], fmts[0].code, qkv_w, fmts[1].code, o_w, cos,
                            sin, k_cache, v_cache, slots, tables, lens_t, starts, heads, kv_heads,
                            head_dim ** -0.5, out, isa=isa)
    _close(out, ref, 1e-4)
    _close(x, x_ref, 1e-5)  # the residual stream (x + residual), or x untouched
    _close(k_cache, kc_ref, 1e-5)
    _close(v_cache, vc_ref, 1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("B,hidden,inter,fmts,first", [
    (1, 96, 160, (Q4_1, Q4_1), False),
    (5, 64, 96, (Q8_0, Q4_0), True),
    (19, 128, 64, (Q4_0, Q8_0), False),  # panels on AVX-512 (16+ rows)
])
def test_mlp_block_equals_reference(isa, B, hidden, inter, fmts, first):
    g = torch.Generator().manual_seed(B * hidden + inter)
    x = torch.randn(B, hidden, generator=g)
    residual = None if first else torch.randn(B, hidden, generator=g)
    norm_w = torch.rand(hidden, generator=g) + 0.5
    gu_w = quantize(torch.randn(2 * inter, hidden, generator=g) * 0.2, fmts[0])
    down_w = quantize(torch.randn(hidden, inter, generator=g) * 0.2, fmts[1])
    x_ref = x.clone()
    ref = layer_blocks.mlp_block(x_ref, residual, norm_w, 1e-5, gu_w, fmts[0], down_w, fmts[1])
    out = torch.empty(B, hidden)
    cpu_lib.mlp_block(x, residual, norm_w, 1e-5, fmts[0].code, gu_w, fmts[1].code, down_w, inter, out,
                      isa=isa)
    _close(out, ref, 1e-4)
    _close(x, x_ref, 1e-5)


def test_op_api_variant_runs_native_and_falls_back_on_other_layouts():
    """The op's CPU variant: the same result as the reference, and a layout the kernel does not
    take (a non-contiguous input) runs the reference instead of failing."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 64, generator=g)
    norm_w = torch.rand(64, generator=g) + 0.5
    gu_w = quantize(torch.randn(192, 64, generator=g) * 0.2, Q4_1)
    down_w = quantize(torch.randn(64, 96, generator=g) * 0.2, Q4_1)
    ref = layer_blocks.mlp_block(x.clone(), None, norm_w, 1e-5, gu_w, Q4_1, down_w, Q4_1)
    _close(layer_blocks.mlp_block_cpu(x.clone(), None, norm_w, 1e-5, gu_w, Q4_1, down_w, Q4_1), ref, 1e-4)
    strided = torch.randn(64, 3, generator=g).T.copy_(x)
    _close(layer_blocks.mlp_block_cpu(strided, None, norm_w, 1e-5, gu_w, Q4_1, down_w, Q4_1), ref, 1e-4)


@pytest.mark.skipif(not cpu_lib.isa_supported("avx512"), reason="the packed path is AVX-512 only")
@pytest.mark.parametrize("B,new", [(1, None), (2, None), (5, None), (3, [12, 1, 7])])
def test_blocks_with_packed_weights_equal_their_reference(B, new):
    """With packed Q4 weights every projection multiplies int16-rounded activations (the packed
    int16 kernel at any row count): the reference rounds the same
    way, so only summation order differs (1e-4 as for the fp32 blocks). Against the fp32
    reference the rounding adds ≤ amax/65534 per value of a block (1.5e-5 of the block's
    largest); through sums of ≤ 192 terms and SwiGLU (slope ≤ 1.1) < 5e-4 of the outputs' scale
    here: asserted 1e-3."""
    g = torch.Generator().manual_seed(11 + B)
    hidden, heads, kv_heads, head_dim, inter, block_size = 96, 3, 1, 32, 160, 16
    lens = [20, 3, 7, 1, 40][:B]
    tables, slots, num_blocks, starts, x, residual, norm_w, qkv_w, o_w, angles = _block_inputs(
        g, lens, new, hidden, heads, kv_heads, head_dim, (Q4_1, Q4_0))
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    attn = (angles.cos(), angles.sin(), k_cache, v_cache, slots, tables, torch.tensor(lens), starts, heads,
            kv_heads, head_dim ** -0.5)
    packed = {"qkv_packed": pack_q4(qkv_w, Q4_1), "o_packed": pack_q4(o_w, Q4_0)}
    fp32 = layer_blocks.attention_block(x.clone(), residual, norm_w, 1e-5, qkv_w, Q4_1, o_w, Q4_0,
                                        *attn[:2], k_cache.clone(), v_cache.clone(), *attn[4:])
    ref = layer_blocks.attention_block(x.clone(), residual, norm_w, 1e-5, qkv_w, Q4_1, o_w, Q4_0,
                                       *attn[:2], k_cache.clone(), v_cache.clone(), *attn[4:], **packed)
    out = layer_blocks.attention_block_cpu(x.clone(), residual, norm_w, 1e-5, qkv_w, Q4_1, o_w, Q4_0,
                                           *attn, **packed)
    _close(out, ref, 1e-4)
    _close(out, fp32, 1e-3)
    gu_w = quantize(torch.randn(2 * inter, hidden, generator=g) * 0.2, Q4_1)
    down_w = quantize(torch.randn(hidden, inter, generator=g) * 0.2, Q4_0)
    packed = (pack_q4(gu_w, Q4_1), pack_q4(down_w, Q4_0))
    fp32 = layer_blocks.mlp_block(x.clone(), residual, norm_w, 1e-5, gu_w, Q4_1, down_w, Q4_0)
    ref = layer_blocks.mlp_block(x.clone(), residual, norm_w, 1e-5, gu_w, Q4_1, down_w, Q4_0, *packed)
    out = layer_blocks.mlp_block_cpu(x.clone(), residual, norm_w, 1e-5, gu_w, Q4_1, down_w, Q4_0, *packed)
    _close(out, ref, 1e-4)
    _close(out, fp32, 1e-3)


def _stack(g: torch.Generator, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int,
           num_blocks: int, block_size: int, fmts) -> layer_blocks.LayerStack:
    def w(n, k, fmt, s):
        return quantize(torch.randn(n, k, generator=g) * s, fmt)

    out = []
    for i in range(layers):
        f = fmts[i % len(fmts)]
        cache = (num_blocks, block_size, kv_heads, head_dim)
        out.append(layer_blocks.StackLayer(
            torch.rand(hidden, generator=g) + 0.5, torch.rand(hidden, generator=g) + 0.5,
            (w((heads + 2 * kv_heads) * head_dim, hidden, f, 0.1), w(hidden, heads * head_dim, f, 0.1),
               w(2 * inter, hidden, f, 0.2), w(hidden, inter, f, 0.2)), (f,) * 4, (None,) * 4,
            torch.randn(*cache, generator=g), torch.randn(*cache, generator=g)))
    return layer_blocks.LayerStack(out, torch.rand(hidden, generator=g) + 0.5, 1e-5, heads, kv_heads, head_dim,
                                   inter, head_dim ** -0.5, use_packed=False)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("new", [None, [17, 1]], ids=["decode", "extend"])
def test_whole_stack_call_equals_the_blocks_layer_by_layer_and_the_reference(isa, new):
    """`fused_layers` (every layer and the final norm in one native call) gives the per-layer
    native blocks' result bit for bit (the same kernels in the same order, the residual stream
    carried as the model carries it) and the reference's within the blocks' bound; the caches
    receive the same keys and values."""
    g = torch.Generator().manual_seed(3)
    hidden, heads, kv_heads, head_dim, inter, block_size = 96, 3, 1, 32, 160, 16
    lens = [20, 3]
    tables, slots, num_blocks = _tables(lens, block_size, g, new)
    M = len(slots)
    stack = _stack(g, 3, hidden, heads, kv_heads, head_dim, inter, num_blocks, block_size, (Q4_1, Q8_0, Q4_0))
    angles = torch.rand(M, head_dim // 2, generator=g) * 6.28
    starts = None if new is None else torch.tensor([0, *new]).cumsum(0)
    step = (angles.cos(), angles.sin(), slots, tables, torch.tensor(lens), starts)
    x = torch.randn(M, hidden, generator=g)

    def caches(s):
        return [(L.k_cache.clone(), L.v_cache.clone()) for L in s.layers]

    def with_caches(s, cs):
        return layer_blocks.LayerStack([layer_blocks.StackLayer(L.attn_norm, L.mlp_norm, L.weights, L.fmts, L.packed,
                                                                *c) for L, c in zip(s.layers, cs)],
                                       s.final_norm, s.eps, s.heads, s.kv_heads, s.head_dim, s.inter, s.scale, False)

    ref_stack, cpu_stack = with_caches(stack, caches(stack)), with_caches(stack, caches(stack))
    ref = layer_blocks.fused_layers(x.clone(), ref_stack, *step)
    out = torch.empty_like(x)
    cpu_lib.fused_layers(cpu_stack.table(), x.clone(), cpu_stack.final_norm, 1e-5, *step[:2], *step[2:],
                         heads, kv_heads, head_dim, block_size, inter, head_dim ** -0.5, out, isa=isa)
    _close(out, ref, 1e-4)
    for a, b in zip(cpu_stack.layers, ref_stack.layers):
        _close(a.k_cache, b.k_cache, 1e-5)
        _close(a.v_cache, b.v_cache, 1e-5)
    by_layer, residual, h = with_caches(stack, caches(stack)), None, x.clone()
    for L in by_layer.layers:
        y = torch.empty_like(h)
        cpu_lib.attention_block(h, residual, L.attn_norm, 1e-5, L.fmts[0].code, L.weights[0], L.fmts[1].code,
                                L.weights[1], *step[:2], L.k_cache, L.v_cache, *step[2:], heads, kv_heads,
                                head_dim ** -0.5, y, isa=isa)
        z = torch.empty_like(h)
        cpu_lib.mlp_block(y, h, L.mlp_norm, 1e-5, L.fmts[2].code, L.weights[2], L.fmts[3].code, L.weights[3],
                          inter, z, isa=isa)
        h, residual = z, y
    assert torch.equal(out, cpu_lib.add_rms_norm(h, residual, stack.final_norm, 1e-5))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("lens,new", [([17, 40, 5], None), ([70, 9, 40], [23, 1, 40])], ids=["decode", "extend"])
def test_an_fp16_cache_gets_torchs_rounding_and_is_read_back_exactly(isa, lens, new):
    """--kv-cache-dtype float16: the block stores the K/V rows it computes rounded as
    `tensor.half()` rounds them (the same bits as its fp32 store, halved), and attends over the
    fp16 cache as the reference does."""
    g = torch.Generator().manual_seed(11 + len(lens))
    hidden, heads, kv_heads, head_dim, block_size = 128, 4, 2, 32, 16
    tables, slots, num_blocks, starts, x, residual, norm_w, qkv_w, o_w, angles = _block_inputs(
        g, lens, new, hidden, heads, kv_heads, head_dim, (Q8_0, Q4_1), block_size)
    M = len(slots)
    cos, sin = angles.cos(), angles.sin()
    k32 = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) * 300
    v32 = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) * 1e-5  # fp16 subnormals
    lens_t = torch.tensor(lens)

    def native(k_cache, v_cache):
        out = torch.empty(M, hidden)
        cpu_lib.attention_block(x.clone(), residual, norm_w, 1e-5, Q8_0.code, qkv_w, Q4_1.code, o_w, cos,
                                sin, k_cache, v_cache, slots, tables, lens_t, starts, heads, kv_heads,
                                head_dim ** -0.5, out, isa=isa)
        return out

    native(k32, v32)  # the fp32 store: the rows as the block computes them
    k16, v16 = k32.half(), v32.half()  # unwritten slots were already fp16 values; written ones halved
    kc, vc = k16.clone(), v16.clone()
    out = native(kc, vc)
    assert torch.equal(kc.view(torch.int16), k16.view(torch.int16))
    assert torch.equal(vc.view(torch.int16), v16.view(torch.int16))
    kr, vr = k16.clone(), v16.clone()
    ref = layer_blocks.attention_block(x.clone(), residual, norm_w, 1e-5, qkv_w, Q8_0, o_w, Q4_1, cos, sin, kr,
                                       vr, slots, tables, lens_t, starts, heads, kv_heads, head_dim ** -0.5)
    _close(out, ref, 1e-4)
