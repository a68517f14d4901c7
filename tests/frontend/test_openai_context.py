"""The advertised context fits the KV pool (issue: a 500 for a prompt the pool could not hold,
requests that preempted themselves forever), and a big body does not stall the router.

* Start-up reconciles the pool and the context (``fit_context``): a default pool holds the
  model's context once; a smaller explicit pool lowers it (logged); an explicit
  --max-model-len larger than an explicit pool is refused with a one-line error.
* Requests at the advertised context (prompt + max_tokens = max_model_len) complete, alone and
  two at once, in PD and colocated mode; one token more is a 400 with the numbers, within 0.5 s.
* A big body beside running streams adds no stream gap and no /health latency over 0.5 s.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from pdserve.engine.config import AUTO_KV_MEMORY, ContextDoesNotFit, EngineConfig, fit_context

from tests.frontend.conftest import Server, start_server, stop_server
from tests.frontend.router_cases import API_KEY

BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4   # SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64, fp32
POOL_BLOCKS = 40
POOL_TOKENS = POOL_BLOCKS * 16            # what the small pool below holds: the advertised context
POOL_BYTES = POOL_TOKENS * BYTES_PER_TOKEN
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


# ---- start-up: the pool and the context, reconciled ----------------------------------------------


def test_a_default_pool_holds_the_models_context_once():
    per_block = 16 * BYTES_PER_TOKEN
    fit = fit_context(EngineConfig(), per_block, 8192)
    assert fit.max_model_len == 8192 and fit.num_blocks * 16 >= 8192
    small = fit_context(EngineConfig(), per_block, 512)  # a small context keeps the least pool
    assert small.max_model_len == 512 and small.num_blocks == AUTO_KV_MEMORY // per_block


def test_an_explicit_small_pool_lowers_the_context_and_says_so(caplog):
    fit = fit_context(EngineConfig(kv_cache_memory=POOL_BYTES), 16 * BYTES_PER_TOKEN, 8192)
    assert fit == type(fit)(POOL_BLOCKS, POOL_TOKENS)
    assert f"max_model_len lowered from 8192 to {POOL_TOKENS}" in caplog.text


def test_an_explicit_context_larger_than_an_explicit_pool_is_refused():
    config = EngineConfig(kv_cache_memory=POOL_BYTES, max_model_len=1024)
    with pytest.raises(ContextDoesNotFit, match=rf"--max-model-len 1024 does not fit the KV pool "
                                                rf"\({POOL_BLOCKS} blocks x 16 = {POOL_TOKENS} tokens\)"):
        fit_context(config, 16 * BYTES_PER_TOKEN, 8192)


def test_generate_refuses_it_at_start_with_one_line(default_model_dir):
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "generate", "hi",
                        "--model", default_model_dir, "--threads", "1", "--kv-cache-memory", str(POOL_BYTES),
                        "--max-model-len", "1024"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines == [f"pdserve generate: error: --max-model-len 1024 does not fit the KV pool ({POOL_BLOCKS} "
                     f"blocks x 16 = {POOL_TOKENS} tokens); give --kv-cache-memory 45MiB or more, or "
                     f"--max-model-len {POOL_TOKENS} or less"], r.stderr


# ---- requests at the advertised context ----------------------------------------------------------


@pytest.fixture(scope="module", params=["pd", "colocated"])
def small_pool_server(request, tmp_path_factory) -> Iterator[Server]:
    """`pdserve serve` whose workers' pools hold POOL_TOKENS tokens (the context is lowered to it)."""
    log = tmp_path_factory.mktemp(f"small-pool-{request.param}") / "serve.log"
    server = start_server("--mode", request.param, "--api-key", API_KEY, "--kv-cache-memory", str(POOL_BYTES),
                          "--max-request-bytes", str(8 << 20), log_path=log)
    yield server
    stop_server(server.proc)


def full_context_body(tokenizer, prompt_len: int, max_tokens: int) -> dict:
    hello = tokenizer.encode(" hello")
    assert len(hello) == 1
    return {"model": MODEL, "prompt": hello * prompt_len, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_the_advertised_context_is_what_the_pool_holds(small_pool_server):
    models = httpx.get(f"{small_pool_server.v1}/models", headers=AUTH, timeout=10).json()
    assert models["data"][0]["max_model_len"] == POOL_TOKENS
    assert f"max_model_len lowered from 8192 to {POOL_TOKENS}" in small_pool_server.log_path.read_text()


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("together", [1, 2])
def test_requests_at_the_advertised_context_complete(small_pool_server, tokenizer, together):
    prompt_len = POOL_TOKENS - 48

    async def one(client: httpx.AsyncClient) -> dict:
        r = await client.post("/completions", json=full_context_body(tokenizer, prompt_len, POOL_TOKENS - prompt_len))
        assert r.status_code == 200, r.text
        return r.json()

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=small_pool_server.v1, headers=AUTH, timeout=300) as client:
            return await asyncio.gather(*(one(client) for _ in range(together)))

    for body in asyncio.run(run()):
        usage = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        assert usage == {"prompt_tokens": prompt_len, "completion_tokens": POOL_TOKENS - prompt_len,
                         "total_tokens": POOL_TOKENS}
        assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("prompt_len", [POOL_TOKENS - 48, POOL_TOKENS + 10])
def test_one_token_over_the_context_is_a_400_with_the_numbers(small_pool_server, tokenizer, prompt_len):
    body = full_context_body(tokenizer, prompt_len, POOL_TOKENS - prompt_len + 1 if prompt_len < POOL_TOKENS else 4)
    started = time.monotonic()
    r = httpx.post(f"{small_pool_server.v1}/completions", json=body, headers=AUTH, timeout=30)
    assert time.monotonic() - started < 0.5
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"maximum context length is {POOL_TOKENS} tokens" in message and f"{prompt_len}" in message


# ---- a big body beside running streams -----------------------------------------------------------


async def _watch(server: Server, bodies: list[bytes]) -> tuple[float, float]:
    """4 streams of 60 tokens and a /health probe every 50 ms, with `bodies` posted meanwhile:
    the longest gap between two chunks of a stream and the slowest /health answer."""
    gaps: list[float] = []
    health: list[float] = []
    streaming = asyncio.Event()
    done = asyncio.Event()

    async def stream(client: httpx.AsyncClient) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            last = None
            async for line in r.aiter_lines():
                now = time.monotonic()
                if line.startswith("data: {"):
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    streaming.set()

    async def probe(client: httpx.AsyncClient) -> None:
        while not done.is_set():
            started = time.monotonic()
            r = await client.get("/health")
            assert r.status_code == 200
            health.append(time.monotonic() - started)
            await asyncio.sleep(0.05)

    async def big(client: httpx.AsyncClient) -> None:
        await streaming.wait()
        for raw in bodies:
            r = await client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text

    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300) as client:
        prober = asyncio.create_task(probe(client))
        await asyncio.gather(*(stream(client) for _ in range(4)), big(client))
        done.set()
        await prober
    return max(gaps), max(health)


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("small_pool_server", ["colocated"], indirect=True)  # the router is the same in PD
def test_a_big_body_beside_running_streams_stalls_nothing(small_pool_server):
    six_mb = json.dumps({"model": MODEL, "prompt": "word " * 1_200_000, "max_tokens": 4}).encode()
    # under the size bound (so it is tokenized, off the event loop) yet over the context
    tokenized = json.dumps({"model": MODEL, "prompt": "word " * 30_000, "max_tokens": 4}).encode()
    base_gap, base_health = asyncio.run(_watch(small_pool_server, []))
    gap, health = asyncio.run(_watch(small_pool_server, [six_mb, tokenized, six_mb, tokenized]))
    assert gap <= base_gap + 0.5, (gap, base_gap)
    assert health <= base_health + 0.5, (health, base_health)
