"""CPU an idle `pdserve serve` uses: start it, wait until ready, let it settle, then sum the CPU
time (user + system) of its whole process tree over a window (docs/liveness.md). Below each
process, its threads that ran or woke noticeably: CPU (the scheduler's clock) and wake-ups.

    python bench/idle_cpu.py --tp 3 --window 60
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import cmdline, start_serve, stop_serve, tree, wait_ready  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    except (OSError, IndexError):
        return 0.0


def threads(pid: int) -> dict[int, tuple[str, float, int]]:
    """Each thread of `pid`: (name, CPU seconds on the scheduler's exact clock, voluntary
    context switches: how often it went to sleep, i.e. woke up)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            ran_ns = int((task / "schedstat").read_text().split()[0])
            status = (task / "status").read_text()
            wakes = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue
        out[int(task.name)] = (name, ran_ns / 1e9, wakes)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=3)
    p.add_argument("--mode", default="pd")
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--settle", type=float, default=10.0)
    p.add_argument("--port", type=int, default=8766)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "idle-cpu.json")
    args = p.parse_args()
    proc = start_serve(args.port, args.tp, ["--mode", args.mode] if args.mode != "pd" else [])
    try:
        wait_ready(f"http://127.0.0.1:{args.port}", proc, 900)
        time.sleep(args.settle)  # start-up work (model load, warm-up) is not idle time
        pids = tree(proc.pid)
        names = {q: cmdline(q) for q in pids}
        before = {q: cpu_seconds(q) for q in pids}
        before_threads = {q: threads(q) for q in pids}
        time.sleep(args.window)
        after = {q: cpu_seconds(q) for q in pids}
        after_threads = {q: threads(q) for q in pids}
    finally:
        stop_serve(proc)
    total = 0.0
    report = []
    for q in pids:
        used = after[q] - before[q]
        total += used
        report.append({"pid": q, "command": names[q], "share_of_core": used / args.window})
        print(f"{used / args.window:7.2%}  pid {q}  {names[q]}")
        for tid, (name, ran, wakes) in sorted(after_threads[q].items()):
            _, ran0, wakes0 = before_threads[q].get(tid, (name, 0.0, 0))
            if ran - ran0 > 0.001 * args.window or wakes - wakes0 > args.window:
                print(f"         {(ran - ran0) / args.window:7.3%}  {(wakes - wakes0) / args.window:6.1f} wakes/s"
                      f"  thread {name}")
    print(f"total: {total:.2f} CPU-s over {args.window:.0f} s = {total / args.window:.2%} of one core "
          f"({len(pids)} processes)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tp": args.tp, "mode": args.mode, "window_s": args.window,
                                    "load_average": os.getloadavg(), "total_share_of_core": total / args.window,
                                    "target_share_of_core": 0.01, "processes": report}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
