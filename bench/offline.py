"""Offline generation throughput and per-token latency: pdserve's engine against transformers.

    python bench/offline.py [--batch-sizes 1,8,32,64] [--input-len 64] [--output-len 64]
                            [--threads 1] [--hf-max-batch 64] [--repeats 1] [--out PATH] [--quick]
                            [--kernels auto|torch|native] [--op-bench] [--ab-op NAME]
                            [--device cpu|cuda] [--no-cuda-graphs] [--overlap [--profile]]

Every batch size runs the same random prompts (fixed length, greedy, every request made to emit
exactly --output-len tokens) through the engine (all requests added at once, stepped until done)
and through `transformers` `generate()` (one left-padded batch). Prints a table, writes JSON and
a PNG (tok/s, tok per CPU-second and ms/token vs concurrency) next to it. Per-token times come
from when the caller sees each token: engine `step()` returns, and a logits-processor hook in
transformers. Tokens per CPU-second of this process is the number to compare on a busy machine.
The batch-1 decode step is set against the memory roofline (bytes of weights read per step ÷
30 GB/s); `--op-bench` adds each op's time before and after (bench/op_bench.py). `--ab-op NAMES`
(comma-separated, e.g. paged_attention,rms_norm) runs every engine repeat twice, alternating:
once with those ops of `pdserve_kernels` bound to their torch references (before), once as
chosen (after), so both see the same background load; each batch prints both and the ratio.
`--overlap` instead compares the plain loop with the overlapped one (docs/overlap.md): the
median decode step and its parts from the loop's own timers (forward, plan = observe + agree +
plan + broadcast, poll = the transfer polling within it, apply, the wait for the forward, and
this script's output handling). `--device cuda` runs both systems on the GPU in bfloat16 (the
engine's default dtype there) and skips the CPU roofline. `--profile` (with `--overlap`) also
runs the plain loop's decode steps at the largest batch under torch's profiler and prints where a
step's host time goes: the ops by self time, and the host-device synchronizations per step.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common import RESULTS, environment, int_list, load_average, table, write_json


@dataclass
class Run:
    """One timed generation of a batch; times in seconds from the start of the batch."""

    batch: int
    wall_s: float
    output_tokens: int
    token_times: list[list[float]] = field(repr=False)  # per request, when each token was seen
    step_times: list[float] = field(repr=False)          # duration of every step / forward
    step_ends: list[float] = field(repr=False)           # when each step ended
    cpu_s: float = math.nan                               # this process's CPU time for the run

    def metrics(self) -> dict[str, float]:
        firsts = [t[0] for t in self.token_times if t]
        tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in self.token_times if len(t) > 1]
        per_tok = [t[-1] / len(t) for t in self.token_times if t]
        # decode steps: those after every request has seen its first token
        decode = [d for d, end in zip(self.step_times, self.step_ends) if end > max(firsts, default=0)]
        return {
            "tok_s": self.output_tokens / self.wall_s,
            "tok_per_cpu_s": self.output_tokens / self.cpu_s,
            "cpu_s": self.cpu_s,
            "wall_s": self.wall_s,
            "output_tokens": self.output_tokens,
            "ttft_ms": 1e3 * statistics.fmean(firsts) if firsts else math.nan,
            "tpot_ms": 1e3 * statistics.fmean(tpots) if tpots else math.nan,
            "e2e_ms_per_token": 1e3 * statistics.fmean(per_tok) if per_tok else math.nan,
            "steps": len(self.step_times),
            "step_ms_mean": 1e3 * statistics.fmean(self.step_times) if self.step_times else math.nan,
            "decode_step_ms_p50": 1e3 * statistics.median(decode) if decode else math.nan,
        }


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random ids above the special-token range, the same for every system."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(256, vocab, (batch, length), generator=g).tolist()


def run_engine(llm, prompts: list[list[int]], output_len: int, tag: str) -> Run:
    from pdserve.engine.sampling_params import SamplingParams

    engine = llm.engine
    index = {}
    t0, c0 = time.perf_counter(), time.process_time()
    for i, ids in enumerate(prompts):
        rid = f"{tag}-{i}"
        index[rid] = i
        engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    times: list[list[float]] = [[] for _ in prompts]
    steps: list[float] = []
    ends: list[float] = []
    with torch.inference_mode():
        while engine.has_work():
            s = time.perf_counter()
            result = engine.step()
            outs = result[1] if isinstance(result, tuple) else result  # (plan, outputs) since lockstep
            e = time.perf_counter()
            steps.append(e - s)
            ends.append(e - t0)
            for o in outs:
                if o.token_id is not None:
                    times[index[o.request_id]].append(e - t0)
                if o.finish_reason not in (None, "length"):
                    raise RuntimeError(f"request {o.request_id} ended with {o.finish_reason}: {o.error}")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Run(len(prompts), wall, sum(map(len, times)), times, steps, ends, cpu)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def run_hf(model, prompts: list[list[int]], output_len: int, pad_id: int) -> Run:
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        """Called once per generated position, after the forward: the token's time."""

        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    ids, mask = (t.to(model.device) for t in left_pad(prompts, pad_id))
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id,
                             logits_processor=LogitsProcessorList([Stamp()]))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    new = out.shape[1] - ids.shape[1]
    rel = [s - t0 for s in stamps[:new]]
    steps = [b - a for a, b in zip([0.0] + rel, rel)]
    return Run(len(prompts), wall, new * len(prompts), [list(rel) for _ in prompts], steps, rel, cpu)


def median_run(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda r: r.wall_s)[len(runs) // 2]


def plot(cells: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("tok_s", "output tokens/s (wall)"), ("tok_per_cpu_s", "output tokens per CPU-second"),
              ("tpot_ms", "ms per output token (TPOT)"))
    for system, style in (("engine", "o-"), ("hf", "s--")):
        pts = [(c["batch"], c[system]) for c in cells if c.get(system)]
        for ax, (key, _) in zip(axes, panels):
            if pts:
                ax.plot([x for x, _ in pts], [m[key] for _, m in pts], style, label=system)
    batches = [c["batch"] for c in cells]
    for ax, (_, ylabel) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(x) for x in batches])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32, 64], help="comma-separated")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for both systems")
    p.add_argument("--hf-max-batch", type=int, default=64, help="skip transformers above this batch")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per cell (engine and transformers interleaved); the median run is reported")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="engine prefill budget per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "offline.json", help="JSON path (PNG next to it)")
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "native"],
                   help="the engine's op backend (pdserve_kernels)")
    p.add_argument("--quantization", default="none",
                   help="the engine's weights: none (fp32, what transformers also runs) | auto | gguf | int8 | int4")
    p.add_argument("--op-bench", action="store_true",
                   help="also time each fused/native op before and after (bench/op_bench.py)")
    p.add_argument("--ab-op", default=None, metavar="NAMES",
                   help="alternate each engine run with these ops (comma-separated) on their torch "
                        "references (before) and as chosen (after)")
    p.add_argument("--quick", action="store_true", help="smoke run: batches 1,4; 16 in, 8 out")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the engine and transformers run")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="on a GPU, decode steps op by op (no CUDA graphs)")
    p.add_argument("--profile", action="store_true", help="with --overlap: profile the plain loop's decode steps")
    p.add_argument("--overlap", action="store_true",
                   help="compare the plain loop with the overlapped one (no transformers run)")
    args = p.parse_args(argv)
    if args.quick:  # smaller defaults; flags given explicitly still win
        p.set_defaults(batch_sizes=[1, 4], input_len=16, output_len=8)
        args = p.parse_args(argv)
    return args


def kv_bytes(model_dir: Path, seqs: int, tokens: int, block: int) -> int:
    """A KV pool that holds every sequence at full length, with room to spare."""
    from pdserve.models import read_config

    c = read_config(model_dir)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", c["num_attention_heads"])
    per_token = 2 * c["num_hidden_layers"] * kv_heads * head_dim * 4  # k and v, fp32
    return max(256 << 20, int(1.25 * seqs * (tokens + 2 * block) * per_token))


def overlap_steps(engine, prompts: list[list[int]], output_len: int, tag: str) -> dict[str, float]:
    """Medians over the decode steps of one batch (ms): the step as the caller sees it, and
    its parts from the loop's timers. Only steps where every request decodes count."""
    from pdserve.engine.sampling_params import SamplingParams

    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    loop, rows, seen, last = engine.loop, [], 0, time.perf_counter()
    t0 = last
    with torch.inference_mode():
        while engine.has_work():
            _, outs = engine.step()
            s = time.perf_counter()
            tokens = [o.token_id for o in outs if o.token_id is not None]  # the output handling
            seen += len(tokens)
            now = time.perf_counter()
            if seen >= len(prompts) and len(tokens) == len(prompts):  # a full decode step
                rows.append({"step_ms": now - last, "forward_ms": loop.forward_s, "plan_ms": loop.plan_s,
                             "poll_ms": loop.poll_s, "apply_ms": loop.apply_s, "wait_ms": loop.wait_s,
                             "output_ms": now - s})
            last = now
    wall = time.perf_counter() - t0
    out = {k: 1e3 * statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
    out.update(tok_s=seen / wall, decode_steps=len(rows))
    return out


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def profile_steps(engine, prompts: list[list[int]], output_len: int) -> dict:
    """`output_len` tokens for `prompts` with the profiler on only while every one of them
    decodes (no prompt chunk in the step, the batch at its full size): per step, the host time,
    the device time of the kernels and the synchronizing calls; the ops by self host time."""
    from torch.profiler import ProfilerActivity, profile

    from pdserve.engine.sampling_params import SamplingParams

    def decoding() -> int:
        return sum(1 for s in engine.scheduler.running if s.output_ids)

    for i, ids in enumerate(prompts):
        engine.add_request(f"prof-{i}", ids, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    with torch.inference_mode():
        while engine.has_work() and decoding() < len(prompts):
            engine.step()  # the prompts: not profiled
        cuda = torch.cuda.is_available() and str(engine.config.device).startswith("cuda")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        steps = 0
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            while engine.has_work() and decoding() == len(prompts):
                engine.step()
                steps += 1
        wall = time.perf_counter() - t0
        while engine.has_work():
            engine.step()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") if cuda else 0.0
    per = max(steps, 1)
    syncs = {e.key: e.count / per for e in events if e.key.startswith(SYNC_EVENTS)}
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    out = {"steps": steps, "host_ms_per_step": 1e3 * wall / per, "device_ms_per_step": device_us / 1e3 / per,
           "launches_per_step": launches / per, "syncs_per_step": syncs,
           "top_ops": [{"op": e.key, "count_per_step": e.count / per, "self_host_ms_per_step":
                        e.self_cpu_time_total / 1e3 / per} for e in
                       sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]]}
    print(f"\nprofile: {len(prompts)} streams, {steps} decode steps (profiler on: times include its cost)")
    print(f"per step: {out['host_ms_per_step']:.2f} ms host wall, {out['device_ms_per_step']:.2f} ms of kernels, "
          f"{out['launches_per_step']:.0f} kernel launches; synchronizing calls: "
          + ", ".join(f"{k} {v:.1f}" for k, v in syncs.items()))
    print(table(["op", "calls/step", "self host ms/step"],
                [[r["op"][:60], f"{r['count_per_step']:.1f}", f"{r['self_host_ms_per_step']:.3f}"] for r in out["top_ops"]]))
    return out


def overlap_main(args: argparse.Namespace) -> int:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.models import read_config
    from pdserve.weights import resolve_model_path

    torch.set_num_threads(args.threads)
    model_dir = resolve_model_path(args.model)
    print(f"{load_average()}; threads={args.threads}; model={model_dir}", flush=True)
    most = max(args.batch_sizes)
    vocab = read_config(model_dir)["vocab_size"]
    engines = {}
    for on in (False, True):
        engines[on] = LLMEngine(EngineConfig(
            model=args.model, device=args.device, threads=args.threads, kernels=args.kernels,
            quantization=args.quantization, max_num_seqs=most, max_num_batched_tokens=args.max_num_batched_tokens,
            overlap=on, cuda_graphs=args.cuda_graphs,
            kv_cache_memory=kv_bytes(model_dir, most, args.input_len + args.output_len, 16)))
        overlap_steps(engines[on], make_prompts(2, 8, min(vocab, 300), 999), 4, f"warm{on}")
    cells = []
    for b in args.batch_sizes:
        prompts = make_prompts(b, args.input_len, vocab, args.seed + b)
        for r in range(args.repeats):  # alternate, so both see the same background load
            for on in (False, True):
                cells.append({"batch": b, "overlap": on, "repeat": r,
                              **overlap_steps(engines[on], prompts, args.output_len, f"b{b}r{r}{on}")})
    keys = ["step_ms", "forward_ms", "plan_ms", "poll_ms", "apply_ms", "wait_ms", "output_ms", "tok_s"]
    print(f"\noverlap off/on: {args.input_len} in / {args.output_len} out, greedy, threads={args.threads}, "
          "medians of decode steps (ms)")
    print(table(["batch", "overlap", *keys],
                [[c["batch"], "on" if c["overlap"] else "off", *(f"{c.get(k, math.nan):.3f}" for k in keys)]
                 for c in cells]))
    profile = profile_steps(engines[False], make_prompts(most, args.input_len, vocab, args.seed), args.output_len) \
        if args.profile else None
    for on in engines.values():
        on.close()
    write_json(args.out, {"benchmark": "offline-overlap", "args": _plain(vars(args)), "model_dir": str(model_dir),
                          "environment": environment(), "cells": cells, "profile": profile})
    print(f"wrote {args.out}; end: {load_average()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.overlap:
        return overlap_main(args)
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm import LLM
    from pdserve.models import read_config
    from pdserve.weights import resolve_model_path

    torch.set_num_threads(args.threads)
    model_dir = resolve_model_path(args.model)
    env = environment()
    print(f"{load_average()}; threads={args.threads}; model={model_dir}", flush=True)
    most = max(args.batch_sizes)
    cfg = EngineConfig(model=args.model, device=args.device, threads=args.threads, kernels=args.kernels,
                       cuda_graphs=args.cuda_graphs,
                       quantization=args.quantization, max_num_seqs=most,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_memory=kv_bytes(model_dir, most, args.input_len + args.output_len, 16))
    llm = LLM(cfg)
    vocab = read_config(model_dir)["vocab_size"]
    hf = None if args.no_hf else load_hf(model_dir, args.device)
    warm = make_prompts(2, 8, vocab, seed=999)
    run_engine(llm, warm, 4, "warm")
    if hf:
        run_hf(hf[0], warm, 4, hf[1])

    cells = [measure(b, args, llm, hf, vocab) for b in args.batch_sizes]
    print(f"\noffline generation: {args.input_len} in / {args.output_len} out, greedy, threads={args.threads}")
    print(table(["batch", "engine tok/s", "hf tok/s", "ratio", "engine tok/cpu-s", "hf tok/cpu-s", "cpu ratio",
                 "engine ms/tok", "hf ms/tok", "engine step ms", "hf step ms", "engine TTFT ms", "hf TTFT ms",
                 "load1"], [_row(c) for c in cells]))
    for c in cells:
        if c["hf_skipped"]:
            print(f"transformers skipped at batch {c['batch']}: {c['hf_skipped']}")
    roof = batch1_roofline(llm, cells) if args.device == "cpu" else None
    ops_rows = None
    if args.op_bench:
        import op_bench

        ops_rows = op_bench.all_rows(sorted({1, most}))
        print("\nper op, before (unfused / fp32 dense) and after (what the engine runs now):")
        print(op_bench.report(ops_rows))
    print(f"start: {env['load_average']}; end: {load_average()}")
    data = {"benchmark": "offline", "args": _plain(vars(args)), "model_dir": str(model_dir),
            "kernels": llm.engine.kernels.describe(), "environment": env,
            "load_average_end": list(os.getloadavg()), "cells": cells, "roofline": roof, "ops": ops_rows}
    write_json(args.out, data)
    png = args.out.with_suffix(".png")
    plot(cells, png, f"{model_dir.name}: {args.input_len} in / {args.output_len} out, threads={args.threads}")
    print(f"wrote {args.out} and {png}")
    return 0


def batch1_roofline(llm, cells: list[dict]) -> dict | None:
    """The batch-1 decode step (median) against reading every weight once at the memory bandwidth."""
    import op_bench

    one = next((c for c in cells if c["batch"] == 1), None)
    if one is None:
        return None
    roof = op_bench.roofline(llm.engine.model, one["engine"]["decode_step_ms_p50"] / 1e3)
    print(f"\nbatch-1 decode step: {roof['measured_step_ms']:.2f} ms measured; weights read per step "
          f"{roof['weight_bytes_per_step'] / 1e6:.1f} MB → {roof['roofline_step_ms']:.2f} ms at "
          f"{op_bench.MEMORY_BW / 1e9:.0f} GB/s ({100 * roof['fraction_of_roofline']:.0f} % of the roofline; "
          f"{roof['measured_tok_s']:.1f} tok/s of {roof['roofline_tok_s']:.0f} possible)")
    return roof


def measure(b: int, args: argparse.Namespace, llm, hf: tuple | None, vocab: int) -> dict:
    """One batch size: both systems, `--repeats` times, interleaved so they share the background load."""
    prompts = make_prompts(b, args.input_len, vocab, args.seed + b)
    cell: dict = {"batch": b, "engine": None, "hf": None, "hf_skipped": None}
    if hf is None:
        cell["hf_skipped"] = "--no-hf"
    elif b > args.hf_max_batch:
        cell["hf_skipped"] = f"batch {b} > --hf-max-batch {args.hf_max_batch}"
    runs: dict[str, list[Run]] = {"engine": [], "hf": []}
    if args.ab_op:
        runs["engine_before"] = []
    for r in range(args.repeats):
        if args.ab_op:
            with reference_op(args.ab_op):
                runs["engine_before"].append(run_engine(llm, prompts, args.output_len, f"b{b}r{r}ref"))
        runs["engine"].append(run_engine(llm, prompts, args.output_len, f"b{b}r{r}"))
        if hf is not None and cell["hf_skipped"] is None:
            runs["hf"].append(run_hf(hf[0], prompts, args.output_len, hf[1]))
    for system, rs in runs.items():
        if rs:
            cell[system] = median_run(rs).metrics()
            cell[system]["tok_s_runs"] = [x.output_tokens / x.wall_s for x in rs]
            cell[system]["tok_per_cpu_s_runs"] = [x.output_tokens / x.cpu_s for x in rs]
    cell["load_average_after"] = list(os.getloadavg())
    if args.ab_op:  # medians of the runs; tokens per CPU-second holds best under background load
        before, after = runs["engine_before"], runs["engine"]
        cpu = [statistics.median(r.output_tokens / r.cpu_s for r in rs) for rs in (before, after)]
        wall = [statistics.median(r.output_tokens / r.wall_s for r in rs) for rs in (before, after)]
        # each after-run against the before-run just ahead of it: the pairs share the load
        paired = statistics.median(a.wall_s and r.wall_s / a.wall_s for r, a in zip(before, after))
        cell["ab"] = {"ops": args.ab_op, "tok_per_cpu_s": cpu, "tok_s": wall, "paired_wall_ratio": paired}
        print(f"  batch {b}: {args.ab_op} reference → {llm.engine.kernels.backend.value}: "
              f"{cpu[0]:.1f} → {cpu[1]:.1f} tok/cpu-s ({cpu[1] / cpu[0]:.2f}×), "
              f"{wall[0]:.1f} → {wall[1]:.1f} tok/s (paired runs: {paired:.2f}×)", flush=True)
    print(f"  batch {b}: engine {cell['engine']['tok_s']:.1f} tok/s"
          + (f", hf {cell['hf']['tok_s']:.1f} tok/s" if cell["hf"] else ", hf skipped")
          + f"  ({load_average()})", flush=True)
    return cell


@contextlib.contextmanager
def reference_op(names: str):
    """The ops `names` (comma-separated) of pdserve_kernels run their torch references inside."""
    from pdserve_kernels import dispatch

    ops = [dispatch.OPS[n] for n in names.split(",")]
    chosen = [op.impl for op in ops]
    for op in ops:
        op.impl = op.reference
    try:
        yield
    finally:
        for op, impl in zip(ops, chosen):
            op.impl = impl


def _plain(args: dict) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in args.items()}


def _row(c: dict) -> list[object]:
    e, h = c["engine"], c["hf"] or {}
    ratio = e["tok_s"] / h["tok_s"] if h else None
    cpu_ratio = e["tok_per_cpu_s"] / h["tok_per_cpu_s"] if h else None
    return [c["batch"], e["tok_s"], h.get("tok_s"), ratio, e["tok_per_cpu_s"], h.get("tok_per_cpu_s"), cpu_ratio,
            e["tpot_ms"], h.get("tpot_ms"), e["decode_step_ms_p50"], h.get("decode_step_ms_p50"),
            e["ttft_ms"], h.get("ttft_ms"), c["load_average_after"][0]]


def load_hf(model_dir: Path, device: str = "cpu"):
    """The transformers model on the same weights and device (fp32 on a CPU, bfloat16 on a GPU:
    the engine's dtypes), and its pad id."""
    import transformers

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    gc = model.generation_config
    eos = gc.eos_token_id[0] if isinstance(gc.eos_token_id, list) else gc.eos_token_id
    pad = gc.pad_token_id if gc.pad_token_id is not None else eos
    return model, pad


if __name__ == "__main__":
    sys.exit(main())
