"""Chaos: a streaming and non-streaming load against `pdserve serve` (PD) while processes are
killed and paused at random, then the checks that prove the server healed and nothing leaked
(docs/supervision.md). A fifth of the requests go to the Responses API, a fifth to Anthropic's
Messages API.

Faults, one every ``--every`` seconds on average (uniform in [0.5, 1.5] × that), each on a
process drawn from the server's tree: SIGKILL of a worker's rank 0 or of a follower rank (the
supervisor restarts the whole worker), or SIGSTOP for 1–5 s then SIGCONT of any process, the
router included (the router itself is never killed: nothing above it would restart it).

Checks (the summary also sums the workers' counters over the run: tokens found in the prefix
cache, of them in host memory, blocks evicted, and requests preempted):

* every request either succeeded or failed with an OpenAI error object (a JSON error body, or
  an SSE error event as a stream's last event): never a cut connection, never a stream that
  ends with neither `[DONE]` nor an error (the other APIs: neither their end, a completed or
  incomplete response or `message_stop`, nor their failure event with the error);
* `serve` is still running at the end, and after the last fault the server serves again;
* every worker idle with every KV block free and no room live.

    python bench/chaos.py --duration 300 --tp 1    # starts its own `pdserve serve`

With `--system-words N` every request starts with one shared system prompt of N words and
continues one of a few conversations, so the prefix cache serves hits (on both workers: the decode
worker keeps what it received) while the faults land; `--serve-arg` passes flags to `serve`, for
instance a small pool with a host tier behind it, and `--system-prompts K` draws from K system
prompts, more than the pool holds, so that blocks also move between the tiers:

    python bench/chaos.py --system-words 600 --system-prompts 3 --serve-arg=--kv-cache-memory=64MiB \
        --serve-arg=--host-cache-memory=256MiB

`--priorities` runs the server with `--scheduling-policy priority` and gives requests random
priorities, so the faults also land on a queue and on workers that order by priority. Colocated
(`--serve-arg=--mode=colocated`), the colocated workers' rank 0 is killed too; with a small
`--max-num-seqs` there, requests of a smaller priority preempt running ones while faults land:

    python bench/chaos.py --priorities --serve-arg=--mode=colocated --serve-arg=--workers=2 \
        --serve-arg=--max-num-seqs=2

Exit status 0 when every check passed; the summary is printed as JSON (and --out FILE).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import cmdline, start_serve, stop_serve, tree, wait_ready, workers_idle  # noqa: E402

CHAT = "/v1/chat/completions"
OTHER_API_SHARE = 0.2  # of the requests, to each of the Responses and Messages APIs instead of chat
MODEL = "SmolLM2-135M-Instruct"
HEAL_S = 120.0  # after the last fault: how long the server may take to serve again
PRIORITIES = (-1, 0, 0, 5)  # --priorities: what the requests draw (lower goes first)


@dataclass
class Tally:
    ok: int = 0
    ok_by_api: dict[str, int] = field(default_factory=dict)  # of them, through the other APIs
    errors: dict[str, int] = field(default_factory=dict)   # failed with an error object: by status
    unexpected: list[str] = field(default_factory=list)    # failed without one
    faults: list[str] = field(default_factory=list)

    def error(self, status: int | str) -> None:
        self.errors[str(status)] = self.errors.get(str(status), 0) + 1


TOPICS = ["rain", "bread", "a robot"]


def system_prompts(words: int, count: int) -> list[str]:
    """`count` system prompts of `words` words, the same in every run (none for 0 words)."""
    vocab = ["agent", "tool", "file", "search", "result", "plan", "step", "answer", "check", "user"]
    if words <= 0:
        return [""]
    rngs = [random.Random(1234 + i) for i in range(count)]
    return [" ".join(rng.choice(vocab) for _ in range(words)) for rng in rngs]


@dataclass(frozen=True)
class Mix:
    """What the requests draw from: system prompts ("": none) and priorities (0: none sent)."""

    systems: Sequence[str] = ("",)
    priorities: Sequence[int] = (0,)


def body(rng: random.Random, stream: bool, mix: Mix = Mix()) -> dict:
    """A short question; with a system prompt, also one of a few earlier exchanges before it, so
    requests share the system prompt's blocks and some share a conversation's too."""
    messages = [{"role": "user", "content": f"Tell me about {rng.choice(TOPICS)}."}]
    system = rng.choice(mix.systems)
    if system:
        earlier = [{"role": "user", "content": f"Tell me about {t}."} for t in TOPICS[:rng.randrange(len(TOPICS))]]
        history = [m for u in earlier for m in (u, {"role": "assistant", "content": f"Here is what I know: {u['content']}"})]
        messages = [{"role": "system", "content": system}, *history, *messages]
    priority = rng.choice(mix.priorities)
    return {"model": MODEL, "messages": messages, "max_tokens": rng.choice([8, 32, 96]), "ignore_eos": True,
            "stream": stream, **({"priority": priority} if priority else {})}


@dataclass(frozen=True)
class OtherAPI:
    """An API beside chat that gets a share of the requests, and how its answers end."""

    name: str
    path: str
    request: Callable[[dict], dict]  # the chat body → this API's
    finished: Callable[[dict], bool]  # a 200 body is a finished answer
    ended: Callable[[dict], bool]     # a stream's last event ends it as it should
    failed: Callable[[dict], bool]    # a stream's last event is its failure, with the error


def as_response(chat: dict) -> dict:
    """The same conversation for the Responses API (chat messages are valid input items)."""
    return {"model": MODEL, "input": chat["messages"], "max_output_tokens": chat["max_tokens"],
            "stream": chat["stream"], **({"priority": chat["priority"]} if "priority" in chat else {})}


def as_message(chat: dict) -> dict:
    """The same conversation for the Messages API (its system prompt apart)."""
    system = next((m["content"] for m in chat["messages"] if m["role"] == "system"), "")
    return {"model": MODEL, "system": system, "messages": [m for m in chat["messages"] if m["role"] != "system"],
            "max_tokens": chat["max_tokens"], "stream": chat["stream"]}


OTHER_APIS = [
    OtherAPI("responses", "/v1/responses", as_response,
             lambda b: b.get("status") in ("completed", "incomplete"),
             lambda e: e.get("type") in ("response.completed", "response.incomplete"),
             lambda e: e.get("type") == "response.failed" and bool((e.get("response") or {}).get("error"))),
    OtherAPI("messages", "/v1/messages", as_message,
             lambda b: b.get("type") == "message" and b.get("stop_reason") is not None,
             lambda e: e.get("type") == "message_stop",
             lambda e: e.get("type") == "error" and bool(e.get("error"))),
]


async def one_request(http: httpx.AsyncClient, rng: random.Random, tally: Tally, mix: Mix) -> None:
    stream = rng.random() < 0.7
    draw = rng.random()
    for k, api in enumerate(OTHER_APIS):
        if draw < OTHER_API_SHARE * (k + 1):
            return await other_api(http, api, api.request(body(rng, stream, mix)), tally)
    try:
        if not stream:
            r = await http.post(CHAT, json=body(rng, False, mix))
            if r.status_code == 200:
                tally.ok += 1
            elif "error" in _json(r.text):
                tally.error(r.status_code)
            else:
                tally.unexpected.append(f"HTTP {r.status_code} without an error object: {r.text[:120]!r}")
            return
        async with http.stream("POST", CHAT, json=body(rng, True, mix)) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                if "error" in _json(text):
                    tally.error(r.status_code)
                else:
                    tally.unexpected.append(f"HTTP {r.status_code} without an error object: {text[:120]!r}")
                return
            last = None
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    last = line[6:]
                    if last == "[DONE]" or "error" in _json(last):
                        break
            if last == "[DONE]":
                tally.ok += 1
            elif last is not None and "error" in _json(last):
                tally.error("stream")
            else:
                tally.unexpected.append(f"a stream ended with neither [DONE] nor an error event (last: {last!r:.80})")
    except httpx.HTTPError as e:
        tally.unexpected.append(f"{'stream' if stream else 'request'} cut: {type(e).__name__}: {e}")


async def other_api(http: httpx.AsyncClient, api: OtherAPI, req: dict, tally: Tally) -> None:
    """A call of another API: it succeeds (a stream ends as the API ends one) or fails with an
    error object (a stream: the API's failure event, with the error)."""
    try:
        async with http.stream("POST", api.path, json=req) as r:
            text = (await r.aread()).decode(errors="replace") if r.status_code != 200 or not req["stream"] else ""
            last: dict = {}
            if r.status_code == 200 and req["stream"]:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        last = _json(line[6:])
        if r.status_code != 200:
            if "error" in _json(text):
                tally.error(r.status_code)
            else:
                tally.unexpected.append(f"{api.name}: HTTP {r.status_code} without an error object: {text[:120]!r}")
        elif api.finished(_json(text)) if not req["stream"] else api.ended(last):
            tally.ok += 1
            tally.ok_by_api[api.name] = tally.ok_by_api.get(api.name, 0) + 1
        elif req["stream"] and api.failed(last):
            tally.error("stream")
        else:
            tally.unexpected.append(f"{api.name}: an answer that neither ended nor failed: {(text or last)!r:.120}")
    except httpx.HTTPError as e:
        tally.unexpected.append(f"{api.name} cut: {type(e).__name__}: {e}")


def _json(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def load(url: str, until: float, clients: int, seed: int, tally: Tally, mix: Mix) -> None:
    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0), trust_env=False) as http:
            while time.monotonic() < until:
                await one_request(http, rng, tally, mix)

    await asyncio.gather(*(client(i) for i in range(clients)))


WORKER_COUNTERS = {"hit_tokens": "pdserve:prefix_cache_hits_total",
                   "host_hit_tokens": "pdserve:prefix_cache_host_hits_total",
                   "evicted_blocks": "pdserve:prefix_cache_evictions_total",
                   "preempted": "pdserve:num_preemptions_total"}


async def worker_counts(url: str, until: float, totals: dict[str, int]) -> None:
    """Sum each worker's counters over the run, across its restarts (a restarted worker counts
    from 0 again), so the summary shows the cache (and preemption) at work while faults landed."""
    last: dict[tuple[str, str], int] = {}
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as http:
        while time.monotonic() < until:
            await asyncio.sleep(2.0)
            try:
                workers = (await http.get(url + "/health")).json()["workers"]
                texts = {w["url"]: (await http.get(w["url"] + "/metrics")).text for w in workers}
            except (httpx.HTTPError, ValueError, KeyError):
                continue  # a worker restarting or paused: its counts are taken at the next sample
            for worker, text in texts.items():
                for key, name in WORKER_COUNTERS.items():
                    value = int(sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)))
                    before = last.get((worker, key), 0)
                    totals[key] = totals.get(key, 0) + (value - before if value >= before else value)
                    last[worker, key] = value


def victims(serve_pid: int) -> list[tuple[int, str]]:
    """(pid, what) of every process of the server: the router (launcher) and each rank."""
    out = []
    for pid in tree(serve_pid):
        cmd = cmdline(pid)
        if pid == serve_pid:
            out.append((pid, "router"))
        elif "multiprocessing.spawn" in cmd:
            out.append((pid, "follower rank"))
        elif " prefill " in cmd or " decode " in cmd:
            out.append((pid, ("prefill" if " prefill " in cmd else "decode") + " rank 0"))
        elif " worker --role both " in cmd:  # --serve-arg=--mode=colocated
            out.append((pid, "colocated rank 0"))
    return out


async def faults(serve_pid: int, until: float, every_s: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    while True:
        await asyncio.sleep(every_s * rng.uniform(0.5, 1.5))
        if time.monotonic() >= until:
            return
        procs = victims(serve_pid)
        if not procs:
            continue
        pid, what = rng.choice(procs)
        kill = what != "router" and rng.random() < 0.6
        try:
            if kill:
                os.kill(pid, signal.SIGKILL)
                tally.faults.append(f"SIGKILL {what} ({pid})")
            else:
                pause = rng.uniform(1.0, 5.0)
                os.kill(pid, signal.SIGSTOP)
                tally.faults.append(f"SIGSTOP {what} ({pid}) for {pause:.1f} s")
                await asyncio.sleep(pause)
                os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            continue
        print(f"chaos: {tally.faults[-1]}", file=sys.stderr, flush=True)


async def run(url: str, serve_pid: int, args: argparse.Namespace, tally: Tally, counts: dict[str, int]) -> None:
    until = time.monotonic() + args.duration
    mix = Mix(system_prompts(args.system_words, args.system_prompts), PRIORITIES if args.priorities else (0,))
    await asyncio.gather(load(url, until, args.clients, args.seed, tally, mix),
                         faults(serve_pid, until, args.every, args.seed, tally), worker_counts(url, until, counts))


def serves_again(url: str, timeout_s: float) -> float | None:
    """Seconds until a plain request is served (None: not within `timeout_s`)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            r = httpx.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                             "max_tokens": 4}, timeout=60, trust_env=False)
            if r.status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load and faults")
    p.add_argument("--every", type=float, default=15.0, help="mean seconds between faults")
    p.add_argument("--clients", type=int, default=4, help="concurrent request loops")
    p.add_argument("--tp", type=int, default=1, help="TP ranks per worker (the default model: 1 or 3)")
    p.add_argument("--port", type=int, default=8766)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system-words", type=int, default=0,
                   help="a shared system prompt of this many words before every request (0: none)")
    p.add_argument("--system-prompts", type=int, default=1,
                   help="how many different system prompts the requests draw from (more than the pool holds: "
                        "evicted prefixes come back, from the host tier when there is one)")
    p.add_argument("--priorities", action="store_true",
                   help="serve with --scheduling-policy priority and give the requests priorities "
                        f"{', '.join(map(str, PRIORITIES))} at random (the Messages API's: none)")
    p.add_argument("--serve-arg", action="append", default=[], help="a flag for `pdserve serve` (repeatable)")
    p.add_argument("--log", type=Path, default=None, help="the server's output (default: discarded)")
    p.add_argument("--out", type=Path, default=None, help="write the summary JSON here too")
    args = p.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    url = f"http://127.0.0.1:{args.port}"
    # a fault may come while a worker restarts: no crash-loop verdict for faults we cause
    proc = start_serve(args.port, args.tp, ["--threads", "1", "--restart-max", "1000",
                                            "--worker-arg=--router-lease=30", *args.serve_arg,
                                            *(["--scheduling-policy", "priority"] if args.priorities else [])],
                       args.log)
    tally = Tally()
    summary: dict = {}
    try:
        wait_ready(url, proc, 600)
        started = time.monotonic()
        counts: dict[str, int] = {}
        asyncio.run(run(url, proc.pid, args, tally, counts))
        healed = serves_again(url, HEAL_S)
        idle, loads = workers_idle(url, None, 60)
        summary = {
            "duration_s": round(time.monotonic() - started), "tp": args.tp, "clients": args.clients,
            "system_words": args.system_words, "serve_args": args.serve_arg, "priorities": args.priorities,
            "worker_counts": counts, "system_prompts": args.system_prompts,
            "faults": len(tally.faults), "fault_list": tally.faults,
            "ok": tally.ok, "ok_by_api": tally.ok_by_api, "failed_with_error_object": tally.errors, "unexpected": tally.unexpected[:50],
            "unexpected_count": len(tally.unexpected), "serve_running": proc.poll() is None,
            "served_again_after_s": None if healed is None else round(healed, 1), "workers_idle": idle,
            "loads": [{k: ld[k] for k in ("url", "free_blocks", "total_blocks", "in_flight", "rooms_live")}
                      for ld in loads],
        }
    finally:
        stop_serve(proc)
    summary["passed"] = (not summary.get("unexpected_count") and summary.get("serve_running", False)
                         and summary.get("served_again_after_s") is not None and summary.get("workers_idle", False))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
