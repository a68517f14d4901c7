"""Agent sessions with a long shared system prompt: what the prefix cache buys, turn by turn.

    python bench/multiturn.py                          # 4 sessions × 4 turns, ≈1,200-token system prompt
    python bench/multiturn.py --sessions 2 --turns 3 --system-words 500 --modes colocated
    python bench/multiturn.py --no-llama --pdserve-arg=--kernels=torch
    python bench/multiturn.py --no-llama --modes pd --cache on --scale 2      # 1 vs 2 prefill workers
    python bench/multiturn.py --no-llama --modes colocated --scale 0 --rounds 3  # the ratio's spread
    python bench/multiturn.py --no-llama --modes pd --cache on --routers 2 --routings cache-aware,cache-aware-no-ask

S sessions run at once; each sends T chat turns one after another, every turn resending the
whole conversation so far (the shared system prompt, the user's turns, the answers), greedy
with `ignore_eos` so every answer has exactly `--output-len` tokens. For every server —
`pdserve serve` in PD and colocated mode with the prefix cache on and off (`--no-prefix-cache`),
and llama-server (which reuses a slot's cached prompt) when its binary is present — it reports
TTFT of the first turns and of the later turns, output tok/s, and the prefix cache hit rate
(prompt tokens the server reported as cached over prompt tokens, from
`usage.prompt_tokens_details.cached_tokens`). Prints a table, writes JSON to bench/results/.

`--scale N` adds servers with N workers where one did the work before — N prefill workers in PD
mode (`--prefill-workers N`, one decode worker), N colocated workers (`--workers N`) — once per
`--routings` policy (cache-aware, least-loaded): what cache-aware routing keeps of the hit rate
when the sessions are spread over several caches. Their rows also show the router's routing
decisions (`pdserve:routing_decisions_total`: to a prefix holder, away from a too busy one, by
load).

`--routers N` puts N routers in front of the workers of those servers (the server's own and
N − 1 more `pdserve router`s over its workers, as replicas behind one Service would be), and
each session sends each turn through a different router from its last. `--routings` may name
`cache-aware-no-ask` (cache-aware, `--no-ask-caches`): routers that go only by what each of them
sent where, against the default, which asks the workers what they hold.

`--think S` makes each session wait a random time (uniform on [0, 2S], seeded) between a turn's
answer and its next turn, as an agent does while its tools run. By default (0) every session
sends its next turn at once, so the sessions' turns queue behind each other.

`--rounds N` runs the whole list of servers N times, one after another, so that every server
sees the same drift of the machine. The table then gives each figure's median over the rounds,
and the cache's ratio with its range: the ratio of each round's own cache-off and cache-on
runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import re
import statistics

import httpx

from common import RESULTS, environment, load_average, percentile, table, write_json
from serve_launch import launch, stop

LLAMA_BIN = Path.home() / ".cache" / "pdserve" / "llama.cpp" / "build" / "bin" / "llama-server"
WORDS = ("system agent tool call result file read write search plan step check answer user query "
         "context memory cache block token model server request stream latency budget policy rule "
         "always never when then because output format json list table summary detail error retry").split()


@dataclass
class Turn:
    session: int
    turn: int
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    output_tokens: int = 0
    error: str | None = None


@dataclass
class Target:
    label: str
    command: str
    mode: str
    cache: bool | None  # None: not pdserve
    workers: int = 1    # prefill workers (pd) or colocated workers doing the prefills
    routing: str = "-"  # --routing of the router, with several workers


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def chat(http: httpx.AsyncClient, model: str, messages: list[dict], out_len: int, t: Turn) -> str:
    body = {"model": model, "messages": messages, "max_tokens": out_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    pieces: list[str] = []
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                t.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return ""
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                for c in chunk.get("choices") or []:
                    piece = (c.get("delta") or {}).get("content") or ""
                    if piece and t.ttft is None:
                        t.ttft = time.perf_counter() - t0
                    pieces.append(piece)
                usage = chunk.get("usage")
                if usage:
                    t.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    t.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if "cached_tokens" in details:
                        t.cached_tokens = int(details["cached_tokens"] or 0)
    except (httpx.HTTPError, OSError, ValueError) as e:
        t.error = f"{type(e).__name__}: {e}"[:200]
        return ""
    t.e2e = time.perf_counter() - t0
    return "".join(pieces)


async def session(base_urls: list[str], model: str, s: int, args: argparse.Namespace, system: str) -> list[Turn]:
    """One agent session; turn k goes through router (s + k) mod len(base_urls)."""
    rng = random.Random(args.seed * 1000 + s)
    pauses = random.Random(args.seed * 1000 + s + 500_000)  # apart, so the texts do not depend on --think
    messages = [{"role": "system", "content": system}]
    turns = []
    clients = [httpx.AsyncClient(base_url=url, timeout=args.timeout) for url in base_urls]
    try:
        for k in range(args.turns):
            if k and args.think:  # the agent's own work between turns (tools, reading)
                await asyncio.sleep(pauses.uniform(0.0, 2.0 * args.think))
            messages.append({"role": "user", "content": text(rng, args.user_words)})
            t = Turn(s, k)
            answer = await chat(clients[(s + k) % len(clients)], model, messages, args.output_len, t)
            turns.append(t)
            if t.error:
                break
            messages.append({"role": "assistant", "content": answer})
    finally:
        for http in clients:
            await http.aclose()
    return turns


def summarize(turns: list[Turn], wall: float) -> dict:
    ok = [t for t in turns if t.error is None and t.ttft is not None]
    first = [t.ttft for t in ok if t.turn == 0]
    later = [t.ttft for t in ok if t.turn > 0]
    reported = [t for t in ok if t.cached_tokens is not None]
    prompt = sum(t.prompt_tokens for t in reported)
    later_rep = [t for t in reported if t.turn > 0]
    return {
        "requests": len(turns), "failed": len(turns) - len(ok),
        "ttft_first_p50_s": percentile(first, 50), "ttft_later_p50_s": percentile(later, 50),
        "ttft_later_p90_s": percentile(later, 90),
        "output_tok_s": sum(t.output_tokens for t in ok) / wall if wall else 0.0,
        "hit_rate": sum(t.cached_tokens for t in reported) / prompt if prompt else None,
        "hit_rate_later": (sum(t.cached_tokens for t in later_rep) / sum(t.prompt_tokens for t in later_rep)
                           if later_rep and sum(t.prompt_tokens for t in later_rep) else None),
        "mean_prompt_tokens": sum(t.prompt_tokens for t in ok) / len(ok) if ok else 0.0,
        "wall_s": wall,
    }


def served_model(base_url: str) -> str:
    try:
        return httpx.get(f"{base_url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "default"


def run_target(t: Target, args: argparse.Namespace, system: str) -> dict:
    print(f"launching {t.label}: {t.command}", flush=True)
    try:
        srv = launch(t.command, args.out.parent / "logs", "--port", args.launch_timeout)
    except RuntimeError as e:
        print(f"  launch failed: {e}", flush=True)
        return {**asdict(t), "error": str(e)}
    replicas: list = []
    try:
        if t.workers > 1 and args.routers > 1:
            replicas = [launch(router_command(srv.base_url, t), args.out.parent / "logs", "--port", args.launch_timeout)
                        for _ in range(args.routers - 1)]
        urls = [srv.base_url] + [r.base_url for r in replicas]
        model = served_model(srv.base_url)
        for url in urls:  # an unrelated short request: first-call costs out of the measurement
            asyncio.run(_warm(url, model, Turn(-1, -1)))
        t0 = time.perf_counter()
        results = asyncio.run(_all(urls, model, args, system))
        wall = time.perf_counter() - t0
        routed = {}
        if t.cache is not None:
            for url in urls:
                for why, n in routing_decisions(url).items():
                    routed[why] = routed.get(why, 0) + n
    finally:
        for r in replicas:
            stop(r, args.stop_grace)
        stopped = stop(srv, args.stop_grace)
    turns = [x for r in results for x in r]
    s = summarize(turns, wall)
    print(f"  TTFT first p50 {s['ttft_first_p50_s']:.2f} s, later p50 {s['ttft_later_p50_s']:.2f} s, "
          f"hit rate {s['hit_rate'] if s['hit_rate'] is not None else '-'}, {s['failed']} failed "
          f"({load_average()})", flush=True)
    return {**asdict(t), **s, "routing_decisions": routed, "turns": [asdict(x) for x in turns], "stop": stopped,
            "log": str(srv.log_path), "load1": os.getloadavg()[0]}


def routing_decisions(base_url: str) -> dict[str, float]:
    """The router's routing decisions by reason, from its /metrics ({} when it has none)."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return {}
    out = {}
    for m in re.finditer(r'^pdserve:routing_decisions_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


async def _warm(base_url: str, model: str, t: Turn) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        await chat(http, model, [{"role": "user", "content": "hello"}], 4, t)


async def _all(base_urls: list[str], model: str, args: argparse.Namespace, system: str) -> list[list[Turn]]:
    return await asyncio.gather(*(session(base_urls, model, s, args, system) for s in range(args.sessions)))


def router_command(base_url: str, t: Target) -> str:
    """Another router over the workers of the server at `base_url`, routing as its own does."""
    workers = httpx.get(f"{base_url}/health", timeout=10.0).json()["workers"]
    flag = {"prefill": "--prefill", "decode": "--decode", "both": "--worker"}
    urls = " ".join(f"{flag[w['role']]} {w['url']}" for w in workers)
    return f"{sys.executable} -m pdserve.cli router {urls} {routing_flags(t.routing)}"


def routing_flags(routing: str) -> str:
    """`--routings` names as router flags (cache-aware-no-ask: cache-aware without asking the workers)."""
    return "--routing cache-aware --no-ask-caches" if routing == "cache-aware-no-ask" else f"--routing {routing}"


def targets(args: argparse.Namespace) -> tuple[list[Target], str | None]:
    out, note = [], None
    binary = Path(args.llama_server)
    if args.no_llama:
        note = "--no-llama"
    elif not binary.exists():
        note = f"{binary} not found: build it with `make llama-cpp`"
    else:
        from pdserve.weights.default_model import default_gguf_path
        ctx = args.sessions * 8192
        out.append(Target("llama-server", f"{binary} -m {default_gguf_path()} -t {args.threads} "
                                          f"-np {args.sessions} -c {ctx} --host 127.0.0.1", "-", None))
    extra = " ".join(args.pdserve_arg)
    for mode in args.modes:
        for cache in args.cache:
            flag = "" if cache else "--no-prefix-cache"
            command = f"{sys.executable} -m pdserve.launcher --mode {mode} {flag} {extra}"
            out.append(Target(f"pdserve {mode} cache {'on' if cache else 'off'}", " ".join(command.split()),
                              mode, cache))
        if args.scale > 1:
            many = f"--prefill-workers {args.scale}" if mode == "pd" else f"--workers {args.scale}"
            kind = "prefill workers" if mode == "pd" else "workers"
            for routing in args.routings:
                command = f"{sys.executable} -m pdserve.launcher --mode {mode} {many} {routing_flags(routing)} {extra}"
                out.append(Target(f"pdserve {mode} {args.scale} {kind} {routing}", " ".join(command.split()),
                                  mode, True, args.scale, routing))
    return out, note


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=1200, help="words of the shared system prompt")
    p.add_argument("--user-words", type=int, default=40, help="words of each user turn")
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--think", type=float, default=0.0,
                   help="mean seconds a session waits between its turns (uniform on [0, 2×]); 0: none")
    p.add_argument("--modes", type=lambda s: s.split(","), default=["colocated", "pd"])
    p.add_argument("--cache", type=lambda s: [{"on": True, "off": False}[x] for x in s.split(",")],
                   default=[True, False], help="on,off (default): the one-worker servers to run")
    p.add_argument("--scale", type=int, default=2,
                   help="also run N prefill workers (pd) / N colocated workers, once per --routings "
                        "policy (0 or 1: not)")
    p.add_argument("--routings", type=lambda s: s.split(","), default=["cache-aware", "least-loaded"],
                   help="of cache-aware, cache-aware-no-ask (without asking the workers), least-loaded")
    p.add_argument("--routers", type=int, default=1,
                   help="routers in front of the --scale servers' workers; each turn goes through another")
    p.add_argument("--llama-server", default=str(LLAMA_BIN))
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server -t")
    p.add_argument("--pdserve-arg", action="append", default=[])
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--stop-grace", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="run every server this many times, in turn")
    p.add_argument("--out", type=Path, default=RESULTS / "multiturn.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    system = "You are a careful agent. " + text(random.Random(args.seed), args.system_words)
    servers, note = targets(args)
    env = environment()
    print(f"{load_average()}; {args.sessions} sessions × {args.turns} turns; system prompt "
          f"{args.system_words} words; {args.output_len} output tokens"
          + (f"; {args.think:g} s between turns on average" if args.think else ""), flush=True)
    if note:
        print(f"llama-server not run: {note}", flush=True)
    rounds = []
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"round {r + 1} of {args.rounds}", flush=True)
        rounds.append([{**run_target(t, args, system), "round": r} for t in servers])
    headers = ["server", "TTFT turn 1 p50 s", "TTFT later p50 s", "later p90 s", "tok/s", "hit rate",
               "later hit rate", "prompt tok", "failed", "later TTFT vs cache off", "routed prefix/balance/load"]
    rows = [_row([round_[i] for round_ in rounds], [_cache_off(round_, t.mode) for round_ in rounds])
            for i, t in enumerate(servers)]
    if args.rounds > 1:
        print(f"\nmedians over {args.rounds} rounds; the ratio's range over the rounds in brackets")
    print()
    print(table(headers, rows))
    print(f"\nstart: {env['load_average']}; end: {load_average()}")
    write_json(args.out, {"benchmark": "multiturn", "args": {k: str(v) for k, v in vars(args).items()},
                          "environment": env, "llama_server_note": note, "servers": [x for round_ in rounds for x in round_]})
    print(f"wrote {args.out}")
    return 0 if all("error" not in r and not r["failed"] for round_ in rounds for r in round_) else 1


def _cache_off(results: list[dict], mode: str) -> dict | None:
    """The one-worker cache-off run of `mode` in one round's results."""
    return next((r for r in results if r["mode"] == mode and r.get("cache") is False and "error" not in r), None)


def _row(runs: list[dict], offs: list[dict | None]) -> list:
    """One server's table row: medians over its rounds' runs; the ratio of each round's own
    cache-off run to it, as the median and (with several rounds) the range."""
    ok = [(r, off) for r, off in zip(runs, offs) if "error" not in r]
    if not ok:
        return [runs[0]["label"]] + [None] * 8 + ["launch failed", None]
    def med(key: str) -> float | None:
        values = [r[key] for r, _ in ok if r[key] is not None]
        return statistics.median(values) if values else None

    ratios = sorted(off["ttft_later_p50_s"] / r["ttft_later_p50_s"] for r, off in ok
                    if off and r["ttft_later_p50_s"])
    ratio = None
    if ratios:
        ratio = f"{statistics.median(ratios):.1f}x" + (f" ({ratios[0]:.1f}-{ratios[-1]:.1f})" if len(ratios) > 1 else "")
    routed = [r.get("routing_decisions") or {} for r, _ in ok]
    return [runs[0]["label"], med("ttft_first_p50_s"), med("ttft_later_p50_s"), med("ttft_later_p90_s"),
            med("output_tok_s"), med("hit_rate"), med("hit_rate_later"), med("mean_prompt_tokens"),
            sum(r["failed"] for r, _ in ok), ratio,
            "/".join(str(int(statistics.median(d.get(k, 0) for d in routed))) for k in ("prefix", "balance", "load"))
            if any(routed) else None]


if __name__ == "__main__":
    sys.exit(main())
