"""What bench/serve.py prints and draws: throughput, latency and comparison tables, server
metrics, and the PNG."""
from __future__ import annotations

import re
from pathlib import Path

from common import table


def _short(text: str, width: int = 32) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def report(targets: list[dict]) -> None:
    rows, lat = [], []
    for i, t in enumerate(targets):
        error = " ".join(t.get("error", "").split())[:200]
        print(f"[{i}] {t['target']}" + (f"  (failed: {error})" if error else ""))
    print()
    for i, t in enumerate(targets):
        name = f"[{i}] {_short(t['target'])}"
        for p in t["points"]:
            rows.append([name, p["concurrency"], p["request_rate"], p["completed"], p["failed"],
                         p["request_throughput"], p["output_throughput"], p["goodput"]])
            for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                s = p[m]
                lat.append([name, p["concurrency"], p["request_rate"], m,
                            s["mean"], s["p50"], s["p90"], s["p99"]])
    print(table(["target", "conc", "rate", "ok", "failed", "req/s", "out tok/s", "goodput"], rows))
    print()
    print(table(["target", "conc", "rate", "metric", "mean", "p50", "p90", "p99"], lat))
    if len(targets) > 1 and targets[0]["points"]:
        base = {(p["concurrency"], p["request_rate"]): p for p in targets[0]["points"]}
        cmp = []
        for i, t in enumerate(targets[1:], 1):
            for p in t["points"]:
                b = base.get((p["concurrency"], p["request_rate"]))
                if b:
                    cmp.append([f"[{i}] vs [0]", p["concurrency"], p["request_rate"],
                                _ratio(p["output_throughput"], b["output_throughput"]),
                                _ratio(p["ttft_ms"]["p50"], b["ttft_ms"]["p50"]),
                                _ratio(p["tpot_ms"]["p50"], b["tpot_ms"]["p50"]),
                                _ratio(p["e2e_ms"]["p50"], b["e2e_ms"]["p50"])])
        if cmp:
            print()
            print(table(["compare", "conc", "rate", "tok/s ×", "TTFT p50 ×", "TPOT p50 ×", "E2E p50 ×"],
                        cmp))


def report_metrics(targets: list[dict]) -> None:
    """The server-side transfer/step metrics found, one line per histogram or series."""
    lines = []
    for i, t in enumerate(targets):
        for source, m in (t.get("metrics") or {}).items():
            if not m.get("available"):
                lines.append(f"[{i}] {source}: no /metrics")
                continue
            for name, h in m["histograms"].items():
                lines.append(f"[{i}] {source}: {name} count {h['count']:.0f} mean {h['mean']:.4g} "
                             f"p50 {h['p50']:.4g} p99 {h['p99']:.4g}")
            for name, v in m["series"].items():
                delta = f", change {v['delta']:.6g}" if "delta" in v else ""
                short = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")
                lines.append(f"[{i}] {source}: {short} = {v['value']:.6g} ({v['type']}{delta})")
            if not m["histograms"] and not m["series"]:
                lines.append(f"[{i}] {source}: no pdserve transfer/step metrics")
    if lines:
        print("\nserver metrics (histograms: change during the sweep; others: value after it)")
        print("\n".join(lines))


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def plot(targets: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    panels = (("output_throughput", None, "output tokens/s"), ("ttft_ms", "p50", "TTFT p50 (ms)"),
              ("tpot_ms", "p50", "TPOT p50 (ms)"), ("e2e_ms", "p50", "end-to-end p50 (ms)"))
    for i, t in enumerate(targets):
        pts = t["points"]
        if not pts:
            continue
        labels = [f"c={p['concurrency']}\nr={p['request_rate']:g}" for p in pts]
        for ax, (key, q, ylabel) in zip(axes, panels):
            ax.plot(labels, [p[key][q] if q else p[key] for p in pts], "o-",
                    label=f"[{i}] {_short(t['target'], 48)}")
            ax.set_ylabel(ylabel)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
