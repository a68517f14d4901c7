"""One-call GPU check of the compiled kernels: correctness against the torch reference on fresh
random inputs, then timings against measured ceilings (copy bandwidth, bf16 matmul).

    python bench/gpu_check.py [--json bench/results/gpu_check.json] [--quick] [--emulate] [--engine]

Every output is pre-filled with a NaN sentinel, so an element the kernel never wrote fails the
check. On SM120 the block-scaled NVFP4 GEMM is checked too. Without a GPU it runs the reference
computations on the CPU (so the script is known to work) and exits 0 with the reason;
`--emulate` runs every check on the CPU with the references standing in for the kernels, which
tests this harness (shapes, sentinels, layouts), not the kernels. Exit 1 when a check fails.

`--engine` (on a GPU) also runs the engine end to end on CUDA (bfloat16, the default model) once
per op backend (`--kernels torch`, then `native`: the csrc/ attention kernels inside the model,
with its decode steps as CUDA graphs and again eagerly), on the same greedy prompts, and compares
them: the tokens agree, and decode tok/s of each. It
then runs the prefix cache's host tier on CUDA (a device pool too small for the prompts, so
their blocks go to host memory and come back on asynchronous copies) against a cache-off run,
and the piecewise prompt graphs against the same engine's eager prompt steps: their time (an
agent's later turn, a cold 512-token chunk) and the greedy tokens.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from pdserve_kernels import cuda_lib
from pdserve_kernels.nvfp4 import (
    dequantize,
    nvfp4_matmul,
    quantize_activation,
    quantize_activation_gs,
    quantize_weight,
    swizzle_scales,
    unswizzle_scales,
)


@dataclass
class Check:
    name: str
    shape: str
    ok: bool
    err: float  # max |got - ref| / max |ref| (0 for bit-exact checks)
    bound: float
    note: str = ""


@dataclass
class Timing:
    name: str
    shape: str
    ms: float
    achieved: float
    unit: str
    ceiling: float
    fraction: float = field(init=False)

    def __post_init__(self) -> None:
        self.fraction = self.achieved / self.ceiling if self.ceiling else 0.0


# ---- references (float32, any device) -----------------------------------------------------

def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> torch.Tensor:
    """q [lq, hq, d], k/v [lk, hkv, d]; causal is bottom-right aligned; empty rows give 0."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    lq, lk = q.shape[0], k.shape[0]
    if causal:
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (lk - lq), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, vf)


def ref_prefill(q, k, v, cu_q: list[int], cu_k: list[int], scale: float, causal: bool):
    outs = [ref_attention(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]],
                          scale, causal) for b in range(len(cu_q) - 1)]
    return torch.cat(outs)


def ref_decode(q, k_cache, v_cache, tables, lens: list[int], scale: float):
    bs = k_cache.shape[1]
    outs = []
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=q.device)
        blocks = tables[b, pos // bs].long()
        k, v = k_cache[blocks, pos % bs], v_cache[blocks, pos % bs]
        outs.append(ref_attention(q[b:b + 1], k, v, scale, causal=False))
    return torch.cat(outs)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return math.inf  # a NaN sentinel survived: an element was never written
    denom = ref.abs().max().item() or 1.0
    return (got.float() - ref.float()).abs().max().item() / denom


# ---- the kernels, or the references standing in for them (--emulate) -------------------

class Emulated:
    """Same signatures as the cuda_lib launches, computed by the references on any device."""

    @staticmethod
    def nvfp4_quantize(x, gs):
        qa = quantize_activation_gs(x, gs)
        return qa.data, swizzle_scales(qa.scale.view(torch.uint8))

    @staticmethod
    def nvfp4_gemv(x, w, w_scale, weight_scale_2, swizzled=False, out=None):
        n, k = w.shape[0], w.shape[1] * 2
        sf = unswizzle_scales(w_scale, n, k // 16) if swizzled else w_scale.reshape(n, k // 16)
        wd = dequantize(w, sf.view(torch.float8_e4m3fn), weight_scale_2)
        return out.copy_(x.float() @ wd.T)

    @staticmethod
    def attn_prefill(q, k, v, cu_q, cu_k, max_q, scale, causal=True, out=None):
        return out.copy_(ref_prefill(q, k, v, cu_q.tolist(), cu_k.tolist(), scale, causal))

    @staticmethod
    def attn_decode(q, k_cache, v_cache, tables, lens, scale, num_splits=1, out=None, workspace=None):
        return out.copy_(ref_decode(q, k_cache, v_cache, tables, lens.tolist(), scale))

    @staticmethod
    def nvfp4_gemm(a, b, sfa, sfb, alpha, out=None):
        m, n, k = a.shape[0], b.shape[0], a.shape[1] * 2
        sa = unswizzle_scales(sfa, m, k // 16).view(torch.float8_e4m3fn)
        sb = unswizzle_scales(sfb, n, k // 16).view(torch.float8_e4m3fn)
        return out.copy_(nvfp4_matmul(a, sa, b, sb, alpha, torch.float32))


K = cuda_lib  # rebound to Emulated by --emulate


# ---- checks -------------------------------------------------------------------------------

def check_quantize(dev: str, small: bool) -> list[Check]:
    out = []
    for m, k in [(1, 64), (37, 96), (130, 4096), (200, 1536)]:
        x = torch.randn(m, k, device=dev).mul(3).to(torch.bfloat16)
        x[0, :16] = 0  # a zero block
        input_scale = (x.float().abs().max() / 2688 * 0.5).reshape(())  # half: some saturate
        ref = quantize_activation(x, input_scale)
        gs = (1.0 / input_scale).to(torch.float32)
        data, sf = K.nvfp4_quantize(x, gs)
        same = torch.equal(data, ref.data) and torch.equal(
            unswizzle_scales(sf, m, k // 16), ref.scale.view(torch.uint8))
        padding_ok = torch.equal(sf, swizzle_scales(ref.scale.view(torch.uint8)))
        out.append(Check("nvfp4_quantize", f"{m}x{k}", same and padding_ok, 0.0, 0.0,
                         "bit-exact incl. zero padding"))
    return out


def check_gemv(dev: str, small: bool) -> list[Check]:
    out = []
    for m, n, k in [(1, 4096, 4096), (3, 1000, 96), (16, 333, 2048), (7, 64, 32)]:
        if small and n * k > 1 << 20:
            continue
        w = torch.randn(n, k, device=dev) * 0.02
        q = quantize_weight(w)
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        ref = x.float() @ dequantize(q.weight, q.weight_scale, q.weight_scale_2).T
        for swizzled in (False, True):
            sf = swizzle_scales(q.weight_scale) if swizzled else q.weight_scale
            y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
            K.nvfp4_gemv(x, q.weight, sf.view(torch.uint8), q.weight_scale_2.item(),
                                swizzled=swizzled, out=y)
            e = rel_err(y, ref)
            out.append(Check("nvfp4_gemv", f"{m}x{n}x{k} swz={int(swizzled)}", e <= 1e-2, e, 1e-2))
    return out


def check_prefill(dev: str, small: bool) -> list[Check]:
    out = []
    cases = [(64, 4, 4, [1, 17, 64, 130], 0), (128, 8, 2, [5, 64, 200], 0),
             (128, 4, 1, [33, 100], 50), (64, 2, 2, [257], 3)]
    for d, hq, hkv, q_lens, extra in cases:
        for causal in (True, False):
            k_lens = [n + extra for n in q_lens]  # extra > 0: chunked prefill over a prefix
            cu_q = [0] + torch.tensor(q_lens).cumsum(0).tolist()
            cu_k = [0] + torch.tensor(k_lens).cumsum(0).tolist()
            q = torch.randn(cu_q[-1], hq, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(cu_k[-1], hkv, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(cu_k[-1], hkv, d, device=dev, dtype=torch.bfloat16)
            scale = d ** -0.5
            o = torch.full_like(q, float("nan"))
            K.attn_prefill(q, k, v, torch.tensor(cu_q, dtype=torch.int32, device=dev),
                                  torch.tensor(cu_k, dtype=torch.int32, device=dev), max(q_lens),
                                  scale, causal, out=o)
            e = rel_err(o, ref_prefill(q, k, v, cu_q, cu_k, scale, causal))
            out.append(Check("attn_prefill", f"d{d} h{hq}/{hkv} q{q_lens}+{extra} c{int(causal)}",
                             e <= 2e-2, e, 2e-2))
    return out


def check_decode(dev: str, small: bool) -> list[Check]:
    out = []
    cases = [(128, 32, 8, 16, [1, 63, 64, 65, 1000], 1), (128, 32, 8, 16, [1, 63, 64, 65, 1000], 4),
             (64, 4, 4, 32, [0, 7, 300], 3), (128, 40, 2, 1, [129, 5], 2), (64, 8, 1, 64, [2048], 8)]
    for d, hq, hkv, bs, lens, splits in cases:
        if small and max(lens) > 1024:
            continue
        batch = len(lens)
        max_blocks = max(1, max(-(-n // bs) for n in lens))
        num_blocks = batch * max_blocks + 3
        k_cache = torch.randn(num_blocks, bs, hkv, d, device=dev, dtype=torch.bfloat16)
        v_cache = torch.randn(num_blocks, bs, hkv, d, device=dev, dtype=torch.bfloat16)
        tables = torch.randperm(num_blocks, device=dev)[:batch * max_blocks].reshape(batch, max_blocks)
        tables = tables.to(torch.int32).contiguous()
        q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
        scale = d ** -0.5
        o = torch.full_like(q, float("nan"))
        K.attn_decode(q, k_cache, v_cache, tables,
                             torch.tensor(lens, dtype=torch.int32, device=dev), scale, splits, out=o)
        e = rel_err(o, ref_decode(q, k_cache, v_cache, tables, lens, scale))
        out.append(Check("attn_decode", f"d{d} h{hq}/{hkv} bs{bs} L{lens} s{splits}", e <= 2e-2, e, 2e-2))
    return out


def check_gemm(dev: str, small: bool) -> list[Check]:
    out = []
    for m, n, k in [(128, 128, 128), (200, 256, 512), (1, 4096, 4096), (37, 96, 1536)]:
        if small and n * k > 1 << 20:
            continue
        w = torch.randn(n, k, device=dev) * 0.02
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        qw = quantize_weight(w)
        input_scale = (x.float().abs().max() / 2688).reshape(())
        xa = quantize_activation(x, input_scale)
        alpha = (input_scale * qw.weight_scale_2).to(torch.float32).reshape(1)
        ref = nvfp4_matmul(xa.data, xa.scale, qw.weight, qw.weight_scale, alpha, torch.float32)
        y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
        K.nvfp4_gemm(xa.data, qw.weight, swizzle_scales(xa.scale.view(torch.uint8)),
                            swizzle_scales(qw.weight_scale.view(torch.uint8)), alpha, out=y)
        e = rel_err(y, ref)
        out.append(Check("nvfp4_gemm_sm120", f"{m}x{n}x{k}", e <= 1e-2, e, 1e-2))
    return out


# ---- timings ------------------------------------------------------------------------------

def time_ms(fn: Callable[[], object], iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def ceilings(dev: str) -> dict[str, float]:
    src = torch.empty(1 << 28, dtype=torch.uint8, device=dev)  # 256 MiB
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / time_ms(lambda: dst.copy_(src)) / 1e6
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm_tflops = 2 * 8192**3 / time_ms(lambda: a @ a, iters=10) / 1e9
    return {"copy_GBps": copy_gbs, "bf16_matmul_TFLOPs": mm_tflops}


def timings(dev: str, ceil: dict[str, float], sm120: bool) -> list[Timing]:
    bw, mm = ceil["copy_GBps"], ceil["bf16_matmul_TFLOPs"]
    out = []
    for m, n, k in [(1, 4096, 4096), (16, 14336, 4096)]:
        q = quantize_weight(torch.randn(n, k, device=dev))
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        sf = q.weight_scale.view(torch.uint8)
        ms = time_ms(lambda: K.nvfp4_gemv(x, q.weight, sf, 1.0))
        nbytes = n * k // 2 + n * k // 16 + 2 * m * (k + n)
        out.append(Timing("nvfp4_gemv", f"{m}x{n}x{k}", ms, nbytes / ms / 1e6, "GB/s", bw))
    x = torch.randn(4096, 4096, device=dev).to(torch.bfloat16)
    gs = torch.tensor(1.0, device=dev)
    ms = time_ms(lambda: K.nvfp4_quantize(x, gs))
    nbytes = (2 + 0.5 + 1 / 16) * x.numel()  # bf16 in, E2M1 + E4M3 out
    out.append(Timing("nvfp4_quantize", "4096x4096", ms, nbytes / ms / 1e6, "GB/s", bw))
    for d in (64, 128):
        b, n, hq, hkv = 4, 2048, 32, 8
        q = torch.randn(b * n, hq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b * n, hkv, d, device=dev, dtype=torch.bfloat16)
        cu = torch.arange(0, b * n + 1, n, dtype=torch.int32, device=dev)
        ms = time_ms(lambda: K.attn_prefill(q, k, k, cu, cu, n, d ** -0.5, True))
        flops = 4 * b * hq * d * n * n / 2
        shape = f"b{b} n{n} h{hq}/{hkv} d{d} causal"
        out.append(Timing("attn_prefill", shape, ms, flops / ms / 1e9, "TFLOP/s", mm))
    for splits in (1, 4):
        b, ctx, hq, hkv, d, bs = 64, 2048, 32, 8, 128, 16
        blocks = b * ctx // bs
        kc = torch.randn(blocks, bs, hkv, d, device=dev, dtype=torch.bfloat16)
        tables = torch.randperm(blocks, device=dev).to(torch.int32).reshape(b, ctx // bs)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
        need = max(cuda_lib.attn_decode_workspace_bytes(b, hq, d, splits), 1)
        ws = torch.empty(need, dtype=torch.uint8, device=dev)
        ms = time_ms(lambda: K.attn_decode(q, kc, kc, tables, lens, d ** -0.5, splits, workspace=ws))
        kv_bytes = 2 * kc.numel() * 2  # K and V, bf16
        shape = f"b{b} ctx{ctx} h{hq}/{hkv} d{d} s{splits}"
        out.append(Timing("attn_decode", shape, ms, kv_bytes / ms / 1e6, "GB/s", bw))
    if sm120:
        m = n = k = 8192
        a = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device=dev)
        sf = torch.full((cuda_lib.nvfp4_sf_bytes(m, k),), 0x38, dtype=torch.uint8, device=dev)
        y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
        ms = time_ms(lambda: K.nvfp4_gemm(a, a, sf, sf, 1.0, out=y))
        tflops = 2 * m * n * k / ms / 1e9  # ceiling: 4x the measured bf16 matmul
        out.append(Timing("nvfp4_gemm_sm120", f"{m}x{n}x{k}", ms, tflops, "TFLOP/s", 4 * mm))
    return out


# ---- driver -------------------------------------------------------------------------------

def cpu_selftest() -> list[Check]:
    """The reference paths of this script on the CPU, small shapes (no kernels involved)."""
    x = torch.randn(5, 64).to(torch.bfloat16)
    xa = quantize_activation(x, (x.float().abs().max() / 2688).reshape(()))
    qw = quantize_weight(torch.randn(32, 64))
    y = nvfp4_matmul(xa.data, xa.scale, qw.weight, qw.weight_scale, 1.0, torch.float32)
    q, k = torch.randn(9, 4, 64), torch.randn(12, 2, 64)
    pre = ref_prefill(q, k, k, [0, 4, 9], [0, 5, 12], 0.125, True)
    kc = torch.randn(6, 4, 2, 64)
    dec = ref_decode(q[:2], kc, kc, torch.tensor([[0, 1, 2], [3, 4, 5]]), [9, 0], 0.125)
    ok = y.shape == (5, 32) and pre.shape == q.shape and torch.isfinite(dec).all().item()
    return [Check("cpu_selftest", "references", bool(ok), 0.0, 0.0, "no GPU: references only")]


ENGINE_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                  "List three prime numbers.", "Explain what a GPU is in one sentence."]


@dataclass
class EngineRun:
    """One backend's end-to-end run: its choice as logged, tokens per prompt, decode speed."""

    backend: str
    selection: str
    tokens: list[list[int]]
    seconds: float
    output_tokens: int

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def run_engine(device: str, kernels: str, max_tokens: int, dtype: str = "bfloat16",
               cuda_graphs: bool = True) -> EngineRun:
    """Generate ENGINE_PROMPTS greedily (one batch, chat template) with `--kernels kernels`
    (and `--no-cuda-graphs` when `cuda_graphs` is false: its run is named `<kernels>_eager`)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = LLM(EngineConfig(device=device, dtype=dtype, kernels=kernels, cuda_graphs=cuda_graphs))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(ENGINE_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), chat=True)  # warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = llm.generate(ENGINE_PROMPTS, params, chat=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = [c.token_ids for c in out]
    graphs, prompts = llm.engine.runner.graphs, llm.engine.runner.prompt_graphs
    name = kernels if cuda_graphs else f"{kernels}_eager"
    # first: the note that carries it is cut at 300 characters
    selection = ("CUDA graphs: " + (graphs.disabled or f"{len(graphs.graphs)} decode") + ", "
                 + (prompts.disabled or f"{len(prompts.graphs)} prompt buckets") + " captured"
                 if graphs is not None and prompts is not None else "no CUDA graphs") + "; " + llm.engine.kernels.describe()
    return EngineRun(name, selection, tokens, seconds, sum(map(len, tokens)))


def compare_engine_runs(ref: EngineRun, other: EngineRun, min_prefix: int = 8) -> Check:
    """`other` against the reference run (torch's, or the cache-off one): every prompt's first `min_prefix` tokens equal
    (bf16 greedy decoding may part later where two logits nearly tie: different summation
    orders round differently), and the share of equal tokens reported."""
    same = total = 0
    prefix_ok = True
    for a, b in zip(ref.tokens, other.tokens):
        n = min(len(a), len(b))
        agree = next((i for i in range(n) if a[i] != b[i]), n)
        prefix_ok &= agree >= min(min_prefix, n) and len(a) == len(b)
        same += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
    share = same / total if total else 0.0
    note = (f"{other.backend}: {share:.0%} tokens equal; {other.tok_s:.1f} tok/s vs {ref.backend} "
            f"{ref.tok_s:.1f} ({other.tok_s / ref.tok_s if ref.tok_s else 0:.2f}x); {other.selection}")
    return Check("engine_" + other.backend, f"{len(ref.tokens)} prompts x {len(ref.tokens[0])} tok",
                 prefix_ok and len(ref.tokens) == len(other.tokens), 1.0 - share, 1.0, note[:300])


HOST_TIER_BLOCKS = 6  # device blocks: too few to keep every prompt's chain, so each one evicts others


def run_host_tier(device: str, max_tokens: int, caching: bool) -> tuple[EngineRun, int]:
    """Every ENGINE_PROMPTS prompt alone, twice over, on a device pool too small to keep them:
    with the prefix cache and a host tier the second pass loads its blocks back from host
    memory (on CUDA: copies on the tier's own stream). Returns the run and the blocks loaded."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    from pdserve.kvcache import KVPool

    pool = LLM(EngineConfig(device=device, dtype="bfloat16", kernels="native")).engine.pool  # to size the pools
    per_block = KVPool.bytes_per_block(pool.layer_specs, pool.block_size)
    del pool
    llm = LLM(EngineConfig(device=device, dtype="bfloat16", kernels="native", prefix_cache=caching,
                           kv_cache_memory=HOST_TIER_BLOCKS * per_block,
                           host_cache_memory=(64 * per_block if caching else 0)))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    tokens = [llm.generate([p], params, chat=True)[0].token_ids for _ in range(2) for p in ENGINE_PROMPTS]
    seconds = time.perf_counter() - t0
    host = llm.engine.allocator.host
    name = "host_tier" if caching else "no_cache"
    return EngineRun(name, llm.engine.kernels.describe(), tokens, seconds, sum(map(len, tokens))), \
        (host.num_loaded if host is not None else 0)


def _prompt_step_ms(engine, prompt: list[int]) -> float:
    """One step of a new request's prompt (its first), in ms; the request then runs to its end."""
    from pdserve.engine.sampling_params import SamplingParams

    engine.add_request(f"p{time.perf_counter_ns()}", prompt, SamplingParams(temperature=0, max_tokens=1))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    engine.run_until_done()
    return ms


def check_prompt_graphs(device: str, max_tokens: int) -> Check:
    """Prompt steps replayed from the piecewise prompt graphs against the same engine's eager
    prompt steps (alternating, decode graphs in both): an agent's later turn (52 new tokens over
    1,280 cached), a cold 512-token chunk, and ENGINE_PROMPTS' greedy tokens."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = LLM(EngineConfig(device=device, dtype="bfloat16", kernels="native"))
    engine, graphs = llm.engine, llm.engine.runner.prompt_graphs
    if graphs is None:
        return Check("engine_prompt_graphs", "-", False, float("nan"), 0.0, "no prompt graphs on this engine")
    rng = random.Random(0)
    base = [rng.randrange(100, 40000) for _ in range(1280)]
    _prompt_step_ms(engine, base)  # cached from now on
    times: dict[str, list[float]] = {}
    runs = {}
    for rnd in range(2):
        for mode in ("eager", "graphs"):
            engine.runner.prompt_graphs = graphs if mode == "graphs" else None
            for label, prompt_of in (("turn", lambda: base + [rng.randrange(100, 40000) for _ in range(52)]),
                                     ("cold", lambda: [rng.randrange(100, 40000) for _ in range(512)])):
                ms = [_prompt_step_ms(engine, prompt_of()) for _ in range(6)]
                times.setdefault(f"{label}-{mode}", []).append(statistics.median(ms[1:]))  # the first captures
            if rnd == 0:
                t0 = time.perf_counter()
                out = llm.generate(ENGINE_PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                  ignore_eos=True), chat=True)
                tokens = [c.token_ids for c in out]
                runs[mode] = EngineRun(f"prompt_{mode}", f"{len(graphs.graphs)} buckets captured", tokens,
                                       time.perf_counter() - t0, sum(map(len, tokens)))
    engine.runner.prompt_graphs = graphs
    check = compare_engine_runs(runs["eager"], runs["graphs"])
    best = {k: min(v) for k, v in times.items()}
    check.name = "engine_prompt_graphs"
    check.ok &= graphs.disabled is None
    check.note = (f"prompt step eager -> graphs: turn (52 over 1,280 cached) {best['turn-eager']:.1f} -> "
                  f"{best['turn-graphs']:.1f} ms, cold 512 {best['cold-eager']:.1f} -> {best['cold-graphs']:.1f} ms; "
                  + check.note)[:300]
    return check


def engine_checks(device: str, max_tokens: int) -> tuple[list[Check], list[dict]]:
    """Run the engine once per backend on `device` and compare each with the torch run (native
    twice: with its steps as CUDA graphs, and eagerly); then the prefix cache's host tier
    against a cache-off run, and the prompt graphs against eager prompt steps."""
    runs = [run_engine(device, "torch", max_tokens), run_engine(device, "native", max_tokens),
            run_engine(device, "native", max_tokens, cuda_graphs=False)]
    checks = [compare_engine_runs(runs[0], r) for r in runs[1:]]
    tokens = min(max_tokens, 32)
    (off, _), (on, loaded) = (run_host_tier(device, tokens, c) for c in (False, True))
    tier = compare_engine_runs(off, on)
    tier.ok &= loaded > 0
    tier.note = f"{loaded} blocks loaded from host memory; " + tier.note
    checks.append(tier)
    checks.append(check_prompt_graphs(device, max_tokens))
    rows = [{"backend": r.backend, "selection": r.selection, "tok_s": r.tok_s, "seconds": r.seconds}
            for r in (*runs, off, on)]
    return checks, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("bench/results/gpu_check.json"))
    parser.add_argument("--quick", action="store_true", help="checks only, no timings")
    parser.add_argument("--emulate", action="store_true",
                        help="CPU, references in place of the kernels: tests this script only")
    parser.add_argument("--engine", action="store_true",
                        help="also run the engine end to end on CUDA with each op backend and compare")
    parser.add_argument("--engine-tokens", type=int, default=64, help="tokens per prompt in --engine")
    args = parser.parse_args(argv)
    global K
    K = Emulated if args.emulate else cuda_lib
    start = time.monotonic()
    avail = cuda_lib.available()
    report: dict = {"available": avail.ok, "reason": avail.reason, "capability": avail.capability}
    if args.emulate:
        avail = cuda_lib.Availability(True, "emulated on the CPU")
        report.update(available=False, reason="emulated: references stand in for the kernels")
        args.quick = True
    if not avail:
        checks, times = cpu_selftest(), []
    else:
        torch.manual_seed(0)
        dev = "cpu" if args.emulate else "cuda"
        sm120 = args.emulate or bool(cuda_lib.available(need_sm120=True))
        report["device"] = "cpu (emulated)" if args.emulate else torch.cuda.get_device_name()
        suites = [check_quantize, check_gemv, check_prefill, check_decode]
        suites += [check_gemm] if sm120 else []
        checks = []
        for suite in suites:
            try:
                checks += suite(dev, args.emulate)  # emulated: skip the largest shapes
            except (cuda_lib.KernelError, RuntimeError, ValueError) as err:
                checks.append(Check(suite.__name__, "-", False, math.inf, 0.0, repr(err)[:200]))
        times = []
        if not args.quick:
            report["ceilings"] = ceilings(dev)
            times = timings(dev, report["ceilings"], sm120)
        if args.engine and not args.emulate:
            try:
                engine, report["engine"] = engine_checks("cuda", args.engine_tokens)
            except Exception as err:  # noqa: BLE001 - any failure of the end-to-end run is a failed check
                engine = [Check("engine", "-", False, math.inf, 0.0, repr(err)[:200])]
            checks += engine
    report["checks"] = [asdict(c) for c in checks]
    report["timings"] = [asdict(t) for t in times]
    report["seconds"] = round(time.monotonic() - start, 1)
    print(f"{'check':<18} {'shape':<46} {'ok':<4} {'err':>9} {'bound':>7}")
    for c in checks:
        ok = "yes" if c.ok else "NO"
        print(f"{c.name:<18} {c.shape[:46]:<46} {ok:<4} {c.err:>9.2e} {c.bound:>7.0e} {c.note}")
    if times:
        print(f"\n{'kernel':<18} {'shape':<36} {'ms':>9} {'achieved':>10} {'unit':<8} {'of max':>7}")
        for t in times:
            print(f"{t.name:<18} {t.shape:<36} {t.ms:>9.3f} {t.achieved:>10.1f} {t.unit:<8} "
                  f"{t.fraction:>7.0%}")
    if not avail or args.emulate:
        print(f"\nno GPU check: {report['reason']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str))
    failed = [c for c in checks if not c.ok]
    print(f"\n{report['seconds']} s, report in {args.json}")
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
