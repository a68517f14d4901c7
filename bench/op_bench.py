"""Per-kernel before/after on the default model's shapes, and the memory roofline of a decode step.

Used by `bench/offline.py --kernels` (also runnable alone: `python bench/op_bench.py [THREADS]
[--extend]`). Each row times one op the way a step runs it, before (the unfused or reference
form) and after (what the engine runs now), as the median of many calls, on this process's torch
threads.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from common import table

MEMORY_BW = 30e9  # bytes/s read with 2 threads on these machines (measured: ≈15 GB/s per thread)


def timeit(fn: Callable[[], object], min_s: float = 0.2, min_calls: int = 10) -> float:
    """Median seconds per call."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_s:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _norm_before(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x + res
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotary_before(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor):
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    cos, sin = torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]

    def rot(x):
        half = x.shape[-1] // 2
        r = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x.float() * cos + r.float() * sin).to(x.dtype)

    return rot(q), rot(k)


def fused_ops(tokens: int, hidden: int = 576, heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
              inter: int = 1536) -> list[dict]:
    """RMSNorm + residual, rotary on q and k, SwiGLU: before and after, `tokens` rows."""
    from pdserve_kernels import silu_and_mul
    from pdserve.layers.norm import RMSNorm
    from pdserve.layers.rotary import RotaryEmbedding

    rows = []
    norm = RMSNorm(hidden, 1e-5)
    x, res = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    rows.append(_row("rmsnorm + residual", tokens,
                     timeit(lambda: _norm_before(x, res, norm.weight, 1e-5)),
                     timeit(lambda: norm(x.clone(), res)) - timeit(lambda: x.clone())))
    rope = RotaryEmbedding(head_dim, 100000.0)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim)
    positions = torch.arange(100, 100 + tokens)
    q, k = qkv[:, :heads], qkv[:, heads:heads + kv_heads]
    rope.cos_sin(positions)  # the table exists after the first step; a step reads it once for all layers
    rows.append(_row("rotary q+k (per layer)", tokens,
                     timeit(lambda: _rotary_before(positions, q, k, rope.inv_freq)),
                     timeit(lambda: rope.rotate(positions, qkv[:, :heads + kv_heads]))))
    gu = torch.randn(tokens, 2 * inter)
    rows.append(_row("silu_and_mul", tokens,
                     timeit(lambda: F.silu(gu[:, :inter]) * gu[:, inter:]),
                     timeit(lambda: silu_and_mul(gu))))
    return rows


def quantized_matmuls(tokens: int) -> list[dict]:
    """Q4_1 matmuls of the default model's projections: fp32 dense (what pdserve ran before),
    the torch reference (dequantize, then matmul), and the native CPU kernel when it is built."""
    import pdserve_kernels.quant as q

    rows = []
    shapes = {"qkv 576→960": (960, 576), "o 576→576": (576, 576), "gate_up 576→3072": (3072, 576),
              "down 1536→576": (576, 1536), "lm_head 576→49152": (49152, 576)}
    native = q.native_available()
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k) * 0.05
        raw = q.quantize(w, q.Q4_1)
        x = torch.randn(tokens, k)
        dense = timeit(lambda: F.linear(x, w))
        ref = timeit(lambda: q.qmatmul(x, raw, q.Q4_1, force="torch"))
        nat = timeit(lambda: q.qmatmul(x, raw, q.Q4_1, force="native")) if native else float("nan")
        rows.append({"op": f"Q4_1 {name}", "tokens": tokens, "before_us": dense * 1e6, "after_us": nat * 1e6,
                     "speedup": dense / nat if native else None, "torch_reference_us": ref * 1e6,
                     "weight_MB_fp32": n * k * 4 / 1e6, "weight_MB_q4_1": raw.numel() / 1e6,
                     "fp32_GB_s": n * k * 4 / dense / 1e9,
                     "q4_1_GB_s": raw.numel() / nat / 1e9 if native else None})
    return rows


def decode_attention(tokens: int, context: int = 256, heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
                     block_size: int = 16) -> list[dict]:
    """One layer's decode attention for `tokens` sequences of `context` cached tokens: the torch
    reference (gather the blocks, padding mask, SDPA) against the native CPU kernel (K/V read in
    place through the block tables)."""
    from pdserve_kernels import attention, attention_cpu, cpu_lib

    per_seq = (context + block_size - 1) // block_size
    blocks = tokens * per_seq
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim)
    tables = torch.randperm(blocks).view(tokens, per_seq)
    q = torch.randn(tokens, heads + 2 * kv_heads, head_dim)[:, :heads]
    starts, lens = list(range(tokens + 1)), [context] * tokens
    ref = timeit(lambda: attention.paged_attention(q, k_cache, v_cache, starts, lens, tables, 0.125))
    nat = (timeit(lambda: attention_cpu.paged_attention_cpu(q, k_cache, v_cache, starts, lens, tables, 0.125))
           if cpu_lib.availability() else float("nan"))
    return [_row(f"decode attention, context {context} (per layer)", tokens, ref, nat)]


def extend_attention(seqs: int, new: int, cached: int, heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
                     block_size: int = 16) -> list[dict]:
    """One layer's attention for `seqs` sequences of `new` new tokens over `cached` cached ones (a
    later agent turn, or a first prompt with `cached` 0): the torch reference (gather the context,
    causal mask, SDPA per sequence) against the native extend kernel (K/V read in place)."""
    from pdserve_kernels import attention, attention_cpu, cpu_lib

    per_seq = (cached + new + block_size - 1) // block_size
    blocks = seqs * per_seq
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim)
    tables = torch.randperm(blocks).view(seqs, per_seq)
    q = torch.randn(seqs * new, heads + 2 * kv_heads, head_dim)[:, :heads]
    starts, lens = [i * new for i in range(seqs + 1)], [cached + new] * seqs
    ref = timeit(lambda: attention.paged_attention(q, k_cache, v_cache, starts, lens, tables, 0.125))
    nat = (timeit(lambda: attention_cpu.paged_attention_cpu(q, k_cache, v_cache, starts, lens, tables, 0.125))
           if cpu_lib.availability() else float("nan"))
    return [_row(f"extend attention, {seqs}×{new} over {cached} (per layer)", seqs * new, ref, nat)]


def extend_rows() -> list[dict]:
    """The extend shapes of docs/cpu-attention.md: a later agent turn (4 × 64 new over 1,300
    cached), a first prompt (512, nothing cached), one sequence's later turn (64 over 1,300)."""
    return extend_attention(4, 64, 1300) + extend_attention(1, 512, 0) + extend_attention(1, 64, 1300)


def native_rms_norm(tokens: int, hidden: int = 576) -> list[dict]:
    """RMSNorm with the residual add: the torch form the engine ran (in-place add, fused
    `rms_norm`) against the one native call."""
    from pdserve_kernels import cpu_lib, norm

    x, res, w = torch.randn(tokens, hidden), torch.randn(tokens, hidden), torch.randn(hidden)
    copy = timeit(lambda: x.clone())
    ref = timeit(lambda: norm.rms_norm(x.clone(), res, w, 1e-5)) - copy
    nat = (timeit(lambda: norm.rms_norm_cpu(x.clone(), res, w, 1e-5)) - copy
           if cpu_lib.availability() else float("nan"))
    return [_row("rmsnorm + residual: torch → native", tokens, ref, nat)]


def _row(op: str, tokens: int, before: float, after: float) -> dict:
    return {"op": op, "tokens": tokens, "before_us": before * 1e6, "after_us": after * 1e6,
            "speedup": before / after if after > 0 else None}


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter and buffer once, except the input
    embedding table (a step reads a few rows of it) unless the LM head is tied to it."""
    seen: set[int] = set()
    total = 0
    embed = getattr(getattr(model, "model", model), "embed_tokens", None)
    tied_to = getattr(getattr(model, "lm_head", None), "tied_to", None) or []
    tied = embed is not None and any(t is embed for t in tied_to)
    skip = set() if tied or embed is None else {id(t) for t in (*embed.parameters(), *embed.buffers())}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in seen or id(t) in skip:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def roofline(model: torch.nn.Module, step_s: float) -> dict:
    """The batch-1 decode step against the time to read its weights once at MEMORY_BW."""
    b = weight_bytes_per_step(model)
    floor = b / MEMORY_BW
    return {"weight_bytes_per_step": b, "roofline_step_ms": floor * 1e3, "measured_step_ms": step_s * 1e3,
            "fraction_of_roofline": floor / step_s if step_s else None,
            "roofline_tok_s": 1 / floor, "measured_tok_s": 1 / step_s if step_s else None}


def report(rows: list[dict]) -> str:
    return table(["op", "tokens", "before µs", "after µs", "speedup"],
                 [[r["op"], r["tokens"], r["before_us"], r["after_us"], r["speedup"]] for r in rows])


def all_rows(tokens: list[int]) -> list[dict]:
    rows = []
    for t in tokens:
        rows += fused_ops(t)
        rows += decode_attention(t)
        rows += native_rms_norm(t)
        rows += quantized_matmuls(t)
    return rows


if __name__ == "__main__":  # op_bench.py [THREADS] [--extend: only the extend attention rows]
    torch.set_num_threads(int(next((a for a in sys.argv[1:] if a.isdigit()), 1)))
    print(open("/proc/loadavg").read().strip(), "(load average)")
    print(report(extend_rows() if "--extend" in sys.argv else all_rows([1, 32]) + extend_rows()))
