"""The load generator of bench/serve.py: prompts, one streamed OpenAI request, one sweep point."""
from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common import summary


@dataclass
class Workload:
    """What to send: lengths (fixed, or uniform within ±range_ratio), endpoint and model name."""

    num_requests: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    endpoint: str = "chat"          # chat | completions
    model: str = "default"
    ignore_eos: bool = True
    seed: int = 0


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds, relative to when it was sent."""

    prompt_tokens: int
    max_tokens: int
    ok: bool = False
    error: str | None = None
    sent_at: float = 0.0                                    # since the sweep point started
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each non-empty chunk
    e2e: float | None = None
    output_tokens: int = 0                                   # usage.completion_tokens, else chunks
    usage_reported: bool = False

    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def _lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


@functools.lru_cache(maxsize=4)
def _tokenizer(tokenizer_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def make_prompts(tokenizer_dir: Path, w: Workload) -> list[tuple[str, int, int]]:
    """(prompt text, its token count, max_tokens) per request; random ids decoded to text, so
    every prompt differs (no shared prefix) and has about the asked-for token count."""
    tok = _tokenizer(tokenizer_dir)
    vocab = tok.get_vocab_size()
    rng = random.Random(w.seed)
    ins = _lengths(w.input_len, w.range_ratio, w.num_requests, rng)
    outs = _lengths(w.output_len, w.range_ratio, w.num_requests, rng)
    prompts = []
    for n_in, n_out in zip(ins, outs):
        ids = [rng.randrange(256, vocab) for _ in range(n_in)]
        for _ in range(3):  # decode → encode changes the count a little; settle it
            text = tok.decode(ids)
            ids = tok.encode(text, add_special_tokens=False).ids[:n_in]
            ids += [rng.randrange(256, vocab) for _ in range(n_in - len(ids))]
        text = tok.decode(ids)
        prompts.append((text, len(tok.encode(text, add_special_tokens=False).ids), n_out))
    return prompts


def request_body(w: Workload, prompt: str, max_tokens: int) -> tuple[str, dict]:
    body: dict = {"model": w.model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if w.ignore_eos:
        body["ignore_eos"] = True
    if w.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def _chunk_text(chunk: dict) -> str:
    out = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        out += choice.get("text") or delta.get("content") or ""
        out += delta.get("reasoning_content") or ""
        if delta.get("tool_calls"):
            out += json.dumps(delta["tool_calls"])
    return out


async def send(client: httpx.AsyncClient, w: Workload, prompt: str, n_in: int, n_out: int,
               start: float) -> RequestResult:
    """Send one streaming request and time its chunks; failures become values, never raise."""
    r = RequestResult(prompt_tokens=n_in, max_tokens=n_out)
    path, body = request_body(w, prompt, n_out)
    t0 = time.perf_counter()
    r.sent_at = t0 - start
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = json.dumps(chunk["error"])[:300]
                    return r
                now = time.perf_counter() - t0
                if _chunk_text(chunk):
                    r.ttft = now if r.ttft is None else r.ttft
                    r.chunk_times.append(now)
                if chunk.get("usage"):
                    r.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    r.usage_reported = True
    except (httpx.HTTPError, httpx.StreamError, OSError, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"[:300]
        return r
    r.e2e = time.perf_counter() - t0
    if not r.usage_reported:
        r.output_tokens = len(r.chunk_times)
    r.ok = r.ttft is not None
    if not r.ok:
        r.error = "stream ended without any output"
    return r


async def run_point(base_url: str, w: Workload, prompts: list[tuple[str, int, int]], concurrency: int,
                    rate: float, timeout: float) -> tuple[list[RequestResult], float]:
    """Send every prompt, at most `concurrency` in flight, arrivals Poisson at `rate` per second
    (inf: all at once). Returns the results and the wall time of the point."""
    rng = random.Random(w.seed + 1)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += 0.0 if rate == float("inf") else rng.expovariate(rate)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        start = time.perf_counter()

        async def one(at: float, p: tuple[str, int, int]) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            async with sem:
                return await send(client, w, p[0], p[1], p[2], start)

        results = await asyncio.gather(*(one(a, p) for a, p in zip(arrivals, prompts)))
        wall = time.perf_counter() - start
    return list(results), wall


def point_summary(results: list[RequestResult], wall: float, slo_ttft: float | None,
                  slo_tpot: float | None) -> dict:
    """Latency percentiles in ms and throughput of one sweep point."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ms = lambda xs: {k: (v * 1e3 if k != "count" else v) for k, v in summary(xs).items()}  # noqa: E731
    good = [r for r in ok if (slo_ttft is None or r.ttft * 1e3 <= slo_ttft)
            and (slo_tpot is None or (r.tpot() or 0.0) * 1e3 <= slo_tpot)]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "wall_s": wall,
        "request_throughput": len(ok) / wall if wall else 0.0,
        "output_tokens": out_tokens, "output_throughput": out_tokens / wall if wall else 0.0,
        "input_tokens": sum(r.prompt_tokens for r in ok),
        "goodput": len(good) / wall if wall and (slo_ttft or slo_tpot) else None,
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
        "ttft_ms": ms([r.ttft for r in ok]),
        "tpot_ms": ms([t for r in ok if (t := r.tpot()) is not None]),
        "itl_ms": ms([x for r in ok for x in r.itls()]),
        "e2e_ms": ms([r.e2e for r in ok]),
        "errors": errors,
    }
