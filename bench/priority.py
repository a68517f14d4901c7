"""Priority scheduling under overload (README, "Priority"). A `pdserve serve` (colocated, or PD
with `--mode pd`) runs at most `--max-running` requests; `--background` clients keep it full
with long requests, and one short foreground request arrives every `--every` seconds on average.
`--bound router` (the default) holds them at the router (`--max-running`): the router's queue
orders them. `--bound worker` holds them at the worker (`--max-num-seqs`; the router lets one
more batch wait there): the worker's scheduler orders them and preempts a running request for a
smaller priority. Measured: each class's time to first token, the foreground's against the
background's, with `--scheduling-policy priority` (background priority 5, foreground -1) and
under `fcfs` (no priorities sent), servers in turn in one run (`--rounds`), the same seeded
arrivals for both.

    .venv/bin/python bench/priority.py --duration 60 --rounds 2 --out bench/results/priority.json

Prints a table (per policy and class: answered, refused with 429, TTFT p50 / p90 / max) and
writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, load_average, percentile, table, write_json  # noqa: E402
from serve_launch import launch, stop  # noqa: E402

CHAT = "/v1/chat/completions"
PRIORITY = {"foreground": -1, "background": 5}
TOPICS = ["rivers", "bread", "clocks", "bees", "glass", "maps"]


@dataclass
class Tally:
    """One class's requests in one run."""

    ttft_s: list[float] = field(default_factory=list)
    refused: int = 0  # 429: no room within the queue's bound
    failed: list[str] = field(default_factory=list)


async def ask(http: httpx.AsyncClient, kind: str, priorities: bool, max_tokens: int, rng: random.Random,
              tally: Tally) -> None:
    """One streamed chat request; its TTFT is the time to the first event."""
    body = {"messages": [{"role": "user", "content": f"Tell me about {rng.choice(TOPICS)}."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    if priorities:
        body["priority"] = PRIORITY[kind]
    started = time.monotonic()
    try:
        async with http.stream("POST", CHAT, json=body) as r:
            if r.status_code == 429:
                tally.refused += 1
                await r.aread()
                return
            if r.status_code != 200:
                tally.failed.append(f"HTTP {r.status_code}: {(await r.aread())[:120]!r}")
                return
            first = None
            async for line in r.aiter_lines():
                if line.startswith("data: ") and first is None:
                    first = time.monotonic() - started
            if first is not None:
                tally.ttft_s.append(first)
    except httpx.HTTPError as e:
        tally.failed.append(f"{type(e).__name__}: {e}")


async def run(url: str, args: argparse.Namespace, priorities: bool) -> dict[str, Tally]:
    """The load for `--duration` s; the same seeded draws whatever the policy."""
    tallies = {kind: Tally() for kind in PRIORITY}
    until = time.monotonic() + args.duration
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), trust_env=False,
                                 limits=httpx.Limits(max_connections=None)) as http:
        async def background(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            while time.monotonic() < until:
                await ask(http, "background", priorities, args.background_tokens, rng, tallies["background"])

        async def foreground() -> None:
            rng = random.Random(args.seed)
            pending = []
            while True:
                await asyncio.sleep(rng.expovariate(1 / args.every))
                if time.monotonic() >= until:
                    break
                pending.append(asyncio.create_task(
                    ask(http, "foreground", priorities, args.foreground_tokens, rng, tallies["foreground"])))
            await asyncio.gather(*pending)

        await asyncio.gather(foreground(), *(background(i) for i in range(args.background)))
    return tallies


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per server")
    p.add_argument("--rounds", type=int, default=1, help="each policy's server this many times, in turn")
    p.add_argument("--max-running", type=int, default=2,
                   help="requests running at once: the router's --max-running or the worker's --max-num-seqs")
    p.add_argument("--bound", choices=("router", "worker"), default="router",
                   help="where --max-running holds the load: the router's queue, or the worker's")
    p.add_argument("--mode", choices=("colocated", "pd"), default="colocated", help="the server's --mode")
    p.add_argument("--background", type=int, default=6, help="clients sending long requests back to back")
    p.add_argument("--background-tokens", type=int, default=48)
    p.add_argument("--every", type=float, default=1.0, help="mean seconds between foreground requests")
    p.add_argument("--foreground-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=Path("bench/results/priority-logs"))
    p.add_argument("--out", type=Path, default=Path("bench/results/priority.json"))
    args = p.parse_args(argv)
    result: dict = {"environment": environment(), "args": {k: str(v) for k, v in vars(args).items()},
                    "load_start": load_average(), "runs": []}
    rows = []
    for round_ in range(args.rounds):
        for policy in ("fcfs", "priority"):
            bound = "--max-running" if args.bound == "router" else "--max-num-seqs"
            command = (f"python -m pdserve.cli serve --mode {args.mode} {bound} {args.max_running} "
                       f"--max-queue 1024 --queue-timeout 300 --scheduling-policy {policy}")
            print(f"round {round_ + 1}: {policy} ...", flush=True)
            srv = launch(command, args.log_dir)
            try:
                tallies = asyncio.run(run(srv.base_url, args, policy == "priority"))
            finally:
                stop(srv)
            for kind, t in tallies.items():
                cells = {"round": round_ + 1, "policy": policy, "class": kind, "answered": len(t.ttft_s),
                         "refused_429": t.refused, "failed": len(t.failed),
                         "ttft_p50_s": percentile(t.ttft_s, 50), "ttft_p90_s": percentile(t.ttft_s, 90),
                         "ttft_max_s": max(t.ttft_s, default=float("nan"))}
                result["runs"].append({**cells, "ttft_s": t.ttft_s, "failures": t.failed[:20]})
                rows.append(list(cells.values()))
    result["load_end"] = load_average()
    print(table(["round", "policy", "class", "answered", "429", "failed", "TTFT p50 s", "p90 s", "max s"], rows))
    print(result["load_start"], "→", result["load_end"])
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0 if not any(r["failed"] for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
