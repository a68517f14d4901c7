"""Soak: a mixed load against `pdserve serve` (PD, tensor-parallel) for a given time, then the checks that
prove nothing leaked (docs/liveness.md).

Load (``--clients`` concurrent loops, each drawing one kind of request at a time): streaming and
non-streaming chat, chat with tools, ``n`` > 1, a JSON schema (``response_format``), 20 top
logprobs, a text completion echoing its prompt with its logprobs, stop strings, a streamed
Responses API call (its events numbered in order, ending with the response), a streamed
Anthropic Messages call (ending with its stop reason and message_stop), streams the
client drops at a random moment, bad requests (400 expected), and now and then a mass abort (a
burst of streams all dropped after their first event). Checks at the end:

* no request failed except by its own abort (a dropped stream) or an intended 429 / 400, and
  every answer has the shape its request asked for (JSON that holds the schema's fields,
  20 alternatives per token, one logprob per echoed prompt token, no stop string in the text);
* RSS of the router and of every worker process, outside the KV pool (shared memory that fills as
  blocks are first used), grew < 5 % from the end of the warm-up;
* open file descriptors flat (within a small slack) from the end of the warm-up;
* every worker idle: no request waiting, running, transferring or in flight, no room live,
  every KV block free.

    python bench/soak.py --duration 120            # starts its own `pdserve serve --tp 3`
    python bench/soak.py --url http://host:8000    # an already running one (no RSS/fd checks)

TP=3 by default: the default model's 9 attention heads do not split over 2 ranks.
Exit status 0 when every check passed; the summary is printed as JSON (and --out FILE).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
RSS_GROWTH_MAX = 0.05
# Sockets of probes and keep-alive pools come and go: the router keeps up to one idle connection
# per stream it had open at once, to its decode and its prefill worker (a 16-stream mass abort
# beside 5 clients: ~50), so how many are kept depends on the peak reached before each sample.
# A leak per request over the soak's hundreds of requests is far above this.
FD_SLACK = 64
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
STOPS = [".", " the"]


@dataclass
class Tally:
    ok: int = 0
    dropped: int = 0            # streams this client dropped on purpose
    rejected_429: int = 0
    bad_400: int = 0            # bad requests answered 400, as intended
    unexpected: list[str] = field(default_factory=list)
    by_kind: dict[str, int] = field(default_factory=dict)

    def count(self, kind: str) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1


def messages(rng: random.Random) -> list[dict]:
    topics = ["the sea", "a robot", "bread", "mountains", "a library", "rain"]
    return [{"role": "user", "content": f"Write a few sentences about {rng.choice(topics)}."}]


# One deck per client loop, shuffled each time it is used up: every kind comes in every round,
# in proportion, however short the soak.
DECK = ["stream"] * 3 + ["plain"] * 2 + ["tools", "n2", "json", "logprobs", "echo", "stop", "responses", "messages",
                                         "drop", "drop", "bad"]
MASS_ABORT_EVERY = 6  # the first client loop's every 6th turn (from its 3rd) is a mass abort


async def one_request(http: httpx.AsyncClient, rng: random.Random, tally: Tally, kind: str) -> None:
    tally.count(kind)
    body: dict = {"messages": messages(rng), "max_tokens": rng.randint(4, 48), "temperature": 0.7}
    if kind == "bad":
        body["temperature"] = -1
        r = await http.post(CHAT, json=body)
        return _judge(tally, kind, r.status_code, r.text, expect=400)
    if kind == "tools":
        body["tools"] = TOOLS
    if kind == "n2":
        body["n"] = 2
    if kind == "json":
        body.update(max_tokens=64, response_format={"type": "json_schema",
                                                    "json_schema": {"name": "person", "schema": SCHEMA}})
    if kind == "logprobs":
        body.update(logprobs=True, top_logprobs=20)
    if kind == "stop":
        body.update(stop=STOPS, n=2)
    if kind == "responses":
        return await _responses(http, tally, {"input": body["messages"][0]["content"], "stream": True,
                                              "max_output_tokens": body["max_tokens"], "temperature": 0.7})
    if kind == "messages":
        return await _messages(http, tally, {"messages": body["messages"], "max_tokens": body["max_tokens"],
                                             "stream": True, "temperature": 0.7})
    if kind == "echo":
        prompt = messages(rng)[0]["content"]
        r = await http.post(COMPLETIONS, json={"prompt": prompt, "echo": True, "logprobs": 5,
                                               "max_tokens": rng.choice([0, 4])})
        return _judge(tally, kind, r.status_code, r.text, check=_echoed(prompt))
    if kind in ("stream", "drop"):
        body["stream"] = True
        drop_after = rng.randint(1, 8) if kind == "drop" else None
        async with http.stream("POST", CHAT, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _judge(tally, kind, r.status_code, r.text)
            events, last = 0, ""
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last = line[6:]
                events += 1
                if drop_after is not None and events >= drop_after:
                    tally.dropped += 1
                    return  # leaving the block closes the connection: the router aborts the rooms
            if last != "[DONE]":
                tally.unexpected.append(f"{kind}: stream ended with {last[:200]!r}")
            else:
                tally.ok += 1
        return
    r = await http.post(CHAT, json=body)
    _judge(tally, kind, r.status_code, r.text, check=CHECKS.get(kind))


async def _events(http: httpx.AsyncClient, tally: Tally, kind: str, path: str, body: dict) -> list[dict] | None:
    """A stream's events (their `data`), or None when it was refused (judged here)."""
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            _judge(tally, kind, r.status_code, r.text)
            return None
        return [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]


async def _responses(http: httpx.AsyncClient, tally: Tally, body: dict) -> None:
    if (events := await _events(http, tally, "responses", RESPONSES, body)) is None:
        return
    numbers = [e.get("sequence_number") for e in events]
    last = events[-1] if events else {}
    if numbers != list(range(len(events))) or last.get("type") not in ("response.completed", "response.incomplete"):
        tally.unexpected.append(f"responses: events {[e.get('type') for e in events][-3:]}, numbers {numbers[:5]}…")
        return
    # the next turn continues the stored response: its prompt holds the whole first turn
    first = last["response"]
    r = await http.post(RESPONSES, json={"previous_response_id": first["id"], "input": "Go on.",
                                         "max_output_tokens": 8, "temperature": 0.7})
    _judge(tally, "responses", r.status_code, r.text, check=lambda answer: None if (
        answer["previous_response_id"] == first["id"]
        and answer["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    ) else f"a continuation of {first['id']}: {answer['previous_response_id']}, {answer['usage']}")


async def _messages(http: httpx.AsyncClient, tally: Tally, body: dict) -> None:
    if (events := await _events(http, tally, "messages", MESSAGES, body)) is None:
        return
    types = [e.get("type") for e in events]
    ends = types[-2:] == ["message_delta", "message_stop"] and events[-2]["delta"].get("stop_reason")
    if not types or types[0] != "message_start" or not ends:
        tally.unexpected.append(f"messages: events {types[:2]}…{types[-3:]}")
    else:
        tally.ok += 1


def _json_holds_the_schema(answer: dict) -> str | None:
    choice = answer["choices"][0]
    if choice["finish_reason"] != "stop":
        return None  # cut by max_tokens: not complete JSON
    value = json.loads(choice["message"]["content"])
    if set(value) != {"name", "age"} or not isinstance(value["age"], int) or not 0 <= value["age"] <= 150:
        return f"does not hold the schema: {value!r}"
    return None


def _twenty_alternatives(answer: dict) -> str | None:
    content = answer["choices"][0]["logprobs"]["content"]
    if len(content) != answer["usage"]["completion_tokens"] or any(len(t["top_logprobs"]) != 20 for t in content):
        return "not one entry with 20 alternatives per output token"
    return None


def _no_stop_string(answer: dict) -> str | None:
    for choice in answer["choices"]:
        if any(stop in (choice["message"]["content"] or "") for stop in STOPS):
            return f"a stop string in the text: {choice['message']['content']!r}"
    return None


def _echoed(prompt: str) -> Callable[[dict], str | None]:
    def check(answer: dict) -> str | None:
        choice, usage = answer["choices"][0], answer["usage"]
        lp = choice["logprobs"]
        if not choice["text"].startswith(prompt) or "".join(lp["tokens"][:usage["prompt_tokens"]]) != prompt:
            return "the echo is not the prompt"
        if len(lp["tokens"]) != usage["prompt_tokens"] + usage["completion_tokens"] or lp["top_logprobs"][0] is not None:
            return "not one logprob entry per prompt and output token"
        return None
    return check


CHECKS: dict[str, Callable[[dict], str | None]] = {
    "json": _json_holds_the_schema, "logprobs": _twenty_alternatives, "stop": _no_stop_string}


def _judge(tally: Tally, kind: str, status: int, text: str, expect: int = 200,
           check: Callable[[dict], str | None] | None = None) -> None:
    if status == expect:
        if expect == 400:
            tally.bad_400 += 1
        elif check is not None and (wrong := _checked(check, text)):
            tally.unexpected.append(f"{kind}: {wrong}")
        else:
            tally.ok += 1
    elif status == 429:
        tally.rejected_429 += 1
    else:
        tally.unexpected.append(f"{kind}: HTTP {status}: {text[:200]}")


def _checked(check: Callable[[dict], str | None], text: str) -> str | None:
    try:
        return check(json.loads(text))
    except (ValueError, KeyError, TypeError, IndexError) as e:
        return f"malformed answer ({type(e).__name__}: {e}): {text[:200]}"


async def mass_abort(http: httpx.AsyncClient, rng: random.Random, tally: Tally, streams: int) -> None:
    """`streams` streams at once, every one dropped after its first event."""
    tally.count("mass_abort")

    async def one() -> None:
        body = {"messages": messages(rng), "max_tokens": 64, "stream": True, "temperature": 0.7}
        async with http.stream("POST", CHAT, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _judge(tally, "mass_abort", r.status_code, r.text)
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    tally.dropped += 1
                    return

    await asyncio.gather(*(one() for _ in range(streams)))


async def load(url: str, seconds: float, clients: int, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0), trust_env=False,
                                 limits=httpx.Limits(max_connections=None)) as http:
        async def loop(i: int) -> None:
            mine = random.Random(rng.random())
            deck: list[str] = []
            turn = 0
            while time.monotonic() < deadline:
                turn += 1
                if not deck:
                    deck = mine.sample(DECK, len(DECK))
                try:
                    if i == 0 and turn % MASS_ABORT_EVERY == 3 % MASS_ABORT_EVERY:
                        await mass_abort(http, mine, tally, 16)
                    else:
                        await one_request(http, mine, tally, deck.pop())
                except httpx.HTTPError as e:
                    tally.unexpected.append(f"transport: {type(e).__name__}: {e}")

        await asyncio.gather(*(loop(i) for i in range(clients)))


# ---- processes -----------------------------------------------------------------------------------


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def sample(pids: list[int]) -> dict[int, tuple[int, int]]:
    """pid → (RSS KiB outside shared memory, open fds) of the processes still alive. A worker's KV
    pool and host tier are shared memory that becomes resident as blocks are first written
    (pdserve/kvcache/pool.py), which is no leak; the heap and the code are the rest."""
    out = {}
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in status.splitlines())
                   if k in ("VmRSS", "RssShmem")}
            rss = kib["VmRSS"] - kib["RssShmem"]
            out[pid] = (rss, len(os.listdir(f"/proc/{pid}/fd")))
        except (OSError, KeyError):  # gone, or a zombie without memory
            continue
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def start_serve(port: int, tp: int, extra: list[str], log: Path | None = None) -> subprocess.Popen:
    """`pdserve serve` in its own session, its output into `log` (or discarded)."""
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--mode", "pd", "--tp", str(tp), "--port", str(port),
           *extra]
    out = log.open("wb") if log is not None else subprocess.DEVNULL
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop_serve(proc: subprocess.Popen) -> None:
    """SIGTERM its process group (it drains), SIGKILL what is left after 90 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=90)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def wait_ready(url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"soak: pdserve serve exited with code {proc.returncode} during start-up "
                             "(its output: --log)")
        try:
            if httpx.get(url + "/ready", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"soak: {url} not ready after {timeout_s:.0f} s")


def workers_idle(url: str, token: str | None, timeout_s: float) -> tuple[bool, list[dict]]:
    """Every worker's /load shows nothing in flight and a full pool (waits up to `timeout_s`)."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    deadline = time.monotonic() + timeout_s
    loads: list[dict] = []
    while True:
        urls = [w["url"] for w in httpx.get(url + "/health", timeout=5, trust_env=False).json()["workers"]]
        loads = [httpx.get(u + "/load", timeout=5, trust_env=False, headers=headers).json() | {"url": u}
                 for u in urls]
        idle = all(ld["waiting"] + ld["running"] + ld["transferring"] + ld["in_flight"] + ld["rooms_live"] == 0
                   and ld["free_blocks"] == ld["total_blocks"] for ld in loads)
        if idle or time.monotonic() > deadline:
            return idle, loads
        time.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (after start-up)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the RSS/fd baseline "
                   "(default: 20 %% of --duration, at least 20 s)")
    p.add_argument("--clients", type=int, default=6, help="concurrent request loops")
    p.add_argument("--tp", type=int, default=3, help="TP ranks per worker (the default model: 1 or 3)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--url", default=None, help="soak a running server instead of starting one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `pdserve serve` flag (repeatable)")
    p.add_argument("--out", default=None, help="also write the JSON summary here")
    p.add_argument("--log", default=None, help="write the server's output here (default: discarded)")
    args = p.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else max(20.0, 0.2 * args.duration)
    token = os.environ.get("PDSERVE_INTERNAL_TOKEN") or None
    proc = None if args.url else start_serve(args.port, args.tp, args.serve_arg,
                                              Path(args.log) if args.log else None)
    url = args.url or f"http://127.0.0.1:{args.port}"
    tally = Tally()
    try:
        wait_ready(url, proc, 900)
        started = time.monotonic()
        asyncio.run(load(url, warmup, args.clients, args.seed, tally))
        pids = tree(proc.pid) if proc is not None else []
        names = {q: cmdline(q) for q in pids}
        workers_idle(url, token, 60)  # sampled in the same state as the end: idle, pools full
        base = sample(pids)
        asyncio.run(load(url, max(0.0, args.duration - (time.monotonic() - started)), args.clients,
                         args.seed + 1, tally))
        idle, loads = workers_idle(url, token, 60)
        end = sample(pids)
    finally:
        if proc is not None:
            stop_serve(proc)
    growth = {pid: {"cmd": names[pid], "rss_kib": [base[pid][0], end[pid][0]],
                    "rss_growth": round(end[pid][0] / base[pid][0] - 1, 4), "fds": [base[pid][1], end[pid][1]]}
              for pid in base if pid in end}
    failures = list(tally.unexpected[:20])
    if tally.unexpected:
        failures.insert(0, f"{len(tally.unexpected)} unexpected outcome(s)")
    for pid, g in growth.items():
        if g["rss_growth"] > RSS_GROWTH_MAX:
            failures.append(f"RSS of {g['cmd']} grew {g['rss_growth']:.1%}")
        if g["fds"][1] > g["fds"][0] + FD_SLACK:
            failures.append(f"fds of {g['cmd']}: {g['fds'][0]} → {g['fds'][1]}")
    if proc is not None and base and set(base) - set(end):
        failures.append("a process of the server exited during the soak")
    if not idle:
        failures.append(f"workers not idle with full pools at the end: {loads}")
    summary = {"duration_s": args.duration, "warmup_s": warmup, "clients": args.clients, "ok": tally.ok,
               "dropped_on_purpose": tally.dropped, "rejected_429": tally.rejected_429, "bad_400": tally.bad_400,
               "unexpected": len(tally.unexpected), "requests_by_kind": tally.by_kind, "processes": growth,
               "workers_at_end": loads, "failures": failures, "passed": not failures}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
