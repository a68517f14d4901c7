"""Serving benchmark: streamed OpenAI requests against one or more servers, swept over
concurrency and Poisson request rate.

    python bench/serve.py --base-url http://127.0.0.1:8000 [--concurrency 1,4,16] [--request-rate inf]
    python bench/serve.py --launch "pdserve serve --mode pd" --launch "pdserve serve --mode colocated"

    python bench/serve.py --overlap-ab [--launch "pdserve serve --mode pd"] [--concurrency 1,8,32]

Each `--launch` command is started with a free `--port`, waited for (GET /health 200), swept,
its /metrics read (pdserve transfer/step metrics, when there are any), then stopped with SIGTERM.
The first target is the baseline the others are compared with. Reports TTFT, ITL, TPOT and
end-to-end latency (mean/p50/p90/p99), output tokens/s, requests/s and failures; writes JSON and
a PNG. TPOT counts tokens by `usage` when the server streams it, else one token per chunk.

`--overlap-ab` compares the plain loop with the overlapped one (docs/overlap.md): the `--launch`
command (default `pdserve serve --mode pd`) runs twice, with `--no-overlap` and `--overlap`, both
servers up at once, the sweep points alternating between them (`--repeats` rounds), the same
prompts each way. For every point it reads each worker's own step timers from its /load
(`step_seconds`: forward, plan + agree + broadcast, transfer polling, apply, the wait for the
forward, output handling) and reports their means per step. A colocated server
(`pdserve serve --mode colocated`, both ways) runs the one-stream points too: PD TTFT against
colocated TTFT at one stream.
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

from common import RESULTS, environment, int_list, load_average, write_json
from serve_client import Workload, make_prompts, point_summary, run_point
from serve_launch import launch, selected_all, snapshot, stop
from serve_report import plot, report, report_metrics


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load (without --launch)")
    p.add_argument("--launch", action="append", default=[],
                   help="server command to start, sweep and stop (repeatable; the first is the baseline)")
    p.add_argument("--port-flag", default="--port", help="flag that gives a launched server its port")
    p.add_argument("--launch-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--stop-grace", type=float, default=60.0,
                   help="seconds a launched server has to exit after SIGTERM before its group is killed")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--model", default=None,
                   help="the request's `model` field (default: the first id of the server's /v1/models)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="directory with tokenizer.json for prompt lengths (default: the default model's)")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16], help="comma-separated sweep")
    p.add_argument("--request-rate", type=_rates, default=[float("inf")],
                   help="Poisson arrivals per second, comma-separated sweep; inf = all at once")
    p.add_argument("--num-requests", type=int, default=32, help="requests per sweep point")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (mean when random)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (mean when random)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="0: fixed lengths; r: uniform in [len·(1−r), len·(1+r)]")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests before each target's sweep")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT bound")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT bound")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "serve.json", help="JSON path (PNG next to it)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run defaults: concurrency 1,4; 8 requests; 16 in, 8 out")
    p.add_argument("--overlap-ab", action="store_true",
                   help="the --launch command (default: pdserve serve --mode pd) with --no-overlap and "
                        "--overlap, alternating, with the workers' step timers; plus colocated at one stream")
    p.add_argument("--repeats", type=int, default=2, help="--overlap-ab: rounds of alternating points")
    p.add_argument("--threads", type=int, default=1,
                   help="--overlap-ab: --threads of every launched server (the same compute both ways)")
    args = p.parse_args(argv)
    if args.quick:  # smaller defaults; flags given explicitly still win
        p.set_defaults(concurrency=[1, 4], num_requests=8, input_len=16, output_len=8, warmup=1)
        args = p.parse_args(argv)
    return args


def _rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def served_model(base_url: str, asked: str | None) -> str:
    """The model name requests carry: the one asked for, else what the server lists first."""
    if asked:
        return asked
    try:
        return httpx.get(f"{base_url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "default"


@dataclass
class Prompts:
    """Prompts of the warm-up and of each sweep point: fresh ones per point (no point reuses
    another's prefixes), the same for every server."""

    warmup: list[tuple[str, int, int]]
    points: list[list[tuple[str, int, int]]]


def make_all_prompts(tok_dir: Path, w: Workload, args: argparse.Namespace) -> Prompts:
    n_points = len(args.concurrency) * len(args.request_rate)
    points = [make_prompts(tok_dir, replace(w, seed=w.seed + i)) for i in range(n_points)]
    warm = make_prompts(tok_dir, replace(w, seed=w.seed + 10_000, num_requests=max(args.warmup, 1)))
    return Prompts(warm[:args.warmup], points)


def warmup(base_url: str, args: argparse.Namespace, w: Workload, prompts: Prompts) -> None:
    if prompts.warmup:
        asyncio.run(run_point(base_url, w, prompts.warmup, len(prompts.warmup), float("inf"), args.timeout))


def sweep(base_url: str, args: argparse.Namespace, w: Workload, prompts: Prompts) -> list[dict]:
    """Every (concurrency, rate) point against one server."""
    points = []
    grid = [(c, rate) for c in args.concurrency for rate in args.request_rate]
    for (c, rate), batch in zip(grid, prompts.points):
        results, wall = asyncio.run(run_point(base_url, w, batch, c, rate, args.timeout))
        s = point_summary(results, wall, args.slo_ttft_ms, args.slo_tpot_ms)
        points.append({"concurrency": c, "request_rate": rate, **s})
        print(f"  c={c} rate={rate}: {s['completed']} ok, {s['failed']} failed, "
              f"{s['output_throughput']:.1f} tok/s, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
              f"TPOT p50 {s['tpot_ms']['p50']:.1f} ms  ({load_average()})", flush=True)
    return points


def run_target(label: str, args: argparse.Namespace, w: Workload, prompts: Prompts) -> dict:
    """Launch (if asked), sweep, read metrics, stop; a failed launch is recorded, not raised."""
    if label == args.base_url:
        w = replace(w, model=served_model(label, args.model))
        warmup(label, args, w, prompts)
        before = snapshot(label)
        points = sweep(label, args, w, prompts)
        return {"target": label, "launched": False, "model": w.model, "points": points,
                "metrics": selected_all(before, snapshot(label))}
    print(f"launching {label!r}", flush=True)
    try:
        srv = launch(label, args.out.parent / "logs", args.port_flag, args.launch_timeout)
    except RuntimeError as e:
        print(f"  launch failed: {e}", flush=True)
        return {"target": label, "launched": True, "error": str(e), "points": []}
    print(f"  healthy on port {srv.port} after {srv.ready_s:.1f}s; log {srv.log_path}", flush=True)
    try:
        w = replace(w, model=served_model(srv.base_url, args.model))
        warmup(srv.base_url, args, w, prompts)
        before = snapshot(srv.base_url)
        points = sweep(srv.base_url, args, w, prompts)
        metrics = selected_all(before, snapshot(srv.base_url))
    finally:
        stopped = stop(srv, args.stop_grace)
    print(f"  stopped: {stopped}", flush=True)
    return {"target": label, "launched": True, "model": w.model, "argv": srv.argv, "ready_s": srv.ready_s,
            "log": str(srv.log_path), "stop": stopped, "points": points, "metrics": metrics}


def _plain(args: dict) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in args.items()}


STEP_PARTS = ("step", "forward", "plan", "poll", "apply", "wait", "output")


def worker_urls(base_url: str) -> dict[str, str]:
    """Role → URL of every worker the router's /health lists."""
    workers = httpx.get(f"{base_url}/health", timeout=10.0).json().get("workers") or []
    return {w.get("role", "worker"): str(w["url"]).rstrip("/") for w in workers if isinstance(w, dict) and w.get("url")}


def step_seconds(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each worker's step timers (sums since its start) from its /load."""
    return {role: httpx.get(f"{url}/load", timeout=10.0).json().get("step_seconds", {}) for role, url in urls.items()}


def per_step(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Mean ms per step with a forward over a point, per worker: the change of each sum ÷ the
    change of the step count (the forward ÷ the forwards)."""
    out = {}
    for role, a in after.items():
        b = before.get(role, {})
        steps = a.get("steps", 0) - b.get("steps", 0)
        forwards = a.get("forwards", 0) - b.get("forwards", 0)
        row = {"steps": steps}
        for k in STEP_PARTS:
            n = forwards if k == "forward" else steps
            row[k] = 1e3 * (a.get(k, 0.0) - b.get(k, 0.0)) / n if n else float("nan")
        out[role] = row
    return out


def overlap_ab(args: argparse.Namespace, tok_dir: Path) -> int:
    """--overlap-ab (module docstring)."""
    import math

    from common import table

    base = (args.launch or ["pdserve serve --mode pd"])[0]
    colocated = "pdserve serve --mode colocated"
    targets = {f"{name} {flag}": f"{cmd} --threads {args.threads} {flag}"
               for name, cmd in (("pd", base), ("colocated", colocated)) for flag in ("--no-overlap", "--overlap")}
    servers, env = {}, environment()
    try:
        for label, cmd in targets.items():
            print(f"launching {cmd!r}", flush=True)
            servers[label] = launch(cmd, args.out.parent / "logs", args.port_flag, args.launch_timeout)
        urls = {label: worker_urls(srv.base_url) for label, srv in servers.items()}
        model = served_model(next(iter(servers.values())).base_url, args.model)
        cells = []
        for c in args.concurrency:
            w = Workload(max(args.num_requests, 2 * c) if c > 1 else args.num_requests, args.input_len,
                         args.output_len, args.random_range_ratio, args.endpoint, model,
                         not args.no_ignore_eos, args.seed + c)
            prompts = make_prompts(tok_dir, w)
            for r in range(args.repeats):
                for label, srv in servers.items():
                    if label.startswith("colocated") and c != 1:
                        continue
                    if r == 0 and c == args.concurrency[0]:  # a warm-up per server
                        asyncio.run(run_point(srv.base_url, w, prompts[:2], 2, float("inf"), args.timeout))
                    before = step_seconds(urls[label])
                    results, wall = asyncio.run(run_point(srv.base_url, w, prompts, c, float("inf"), args.timeout))
                    steps = per_step(before, step_seconds(urls[label]))
                    summary = point_summary(results, wall, None, None)
                    cells.append({"target": label, "concurrency": c, "repeat": r, **summary, "step_ms": steps})
                    print(f"  {label} c={c} r={r}: {summary['completed']} ok, {summary['failed']} failed, "
                          f"{summary['output_throughput']:.1f} tok/s, TTFT p50 {summary['ttft_ms']['p50']:.1f} ms, "
                          f"TPOT p50 {summary['tpot_ms']['p50']:.1f} ms  ({load_average()})", flush=True)
    finally:
        stopped = {label: stop(srv, args.stop_grace) for label, srv in servers.items()}
    rows = []
    for cell in cells:
        for role, st in cell["step_ms"].items():
            rows.append([cell["target"], cell["concurrency"], cell["repeat"], role, cell["output_throughput"],
                         cell["ttft_ms"]["p50"], cell["tpot_ms"]["p50"], st["steps"],
                         *(st[k] for k in STEP_PARTS)])
    print(f"\noverlap off/on: {args.input_len} in / {args.output_len} out, threads={args.threads}; "
          "per-step means (ms) from each worker's timers (steps with a forward)")
    print(table(["target", "c", "rep", "worker", "tok/s", "TTFT p50", "TPOT p50", "steps", *STEP_PARTS], rows))
    ttft = {}
    for label in targets:
        one = [x["ttft_ms"]["p50"] for x in cells if x["target"] == label and x["concurrency"] == 1]
        ttft[label] = statistics.median(one) if one else math.nan
    for flag in ("--no-overlap", "--overlap"):
        pd, colo = ttft[f"pd {flag}"], ttft[f"colocated {flag}"]
        print(f"one stream, {flag}: TTFT p50 PD {pd:.1f} ms, colocated {colo:.1f} ms: PD overhead {pd - colo:.1f} ms")
    print(f"\nstart: {env['load_average']}; end: {load_average()}")
    out = RESULTS / "serve_overlap.json" if args.out == RESULTS / "serve.json" else args.out
    write_json(out, {"benchmark": "serve-overlap", "args": _plain(vars(args)), "environment": env,
                          "targets": targets, "cells": cells, "ttft_one_stream_ms": ttft, "stop": stopped})
    print(f"wrote {out}")
    return 0 if cells and not any(x["failed"] for x in cells) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tok_dir = args.tokenizer
    if tok_dir is None:
        from pdserve.weights import resolve_model_path
        tok_dir = resolve_model_path(None)
    if args.overlap_ab:
        return overlap_ab(args, tok_dir)
    w = Workload(args.num_requests, args.input_len, args.output_len, args.random_range_ratio,
                 args.endpoint, args.model or "default", not args.no_ignore_eos, args.seed)
    prompts = make_all_prompts(tok_dir, w, args)
    env = environment()
    print(f"{load_average()}; {args.num_requests} requests/point, {args.input_len} in / {args.output_len} out, "
          f"endpoint {args.endpoint}", flush=True)
    targets = [run_target(label, args, w, prompts) for label in (args.launch or [args.base_url])]
    print()
    report(targets)
    report_metrics(targets)
    print(f"\nstart: {env['load_average']}; end: {load_average()}")
    data = {"benchmark": "serve", "args": _plain(vars(args)),
            "workload": asdict(w), "environment": env, "load_average_end": list(os.getloadavg()),
            "targets": targets}
    write_json(args.out, data)
    png = args.out.with_suffix(".png")
    plot(targets, png, f"{args.input_len} in / {args.output_len} out, {args.num_requests} requests per point")
    print(f"wrote {args.out} and {png}")
    return 0 if all(t["points"] and not any(p["failed"] for p in t["points"]) for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
