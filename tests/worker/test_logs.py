"""Worker logs (--log-json): every record about a request carries its id as `request_id`,
whichever thread or process made it (HTTP handler, scheduler loop, transfer agent, TP rank)."""
from __future__ import annotations

import asyncio
import json

import pytest

from .conftest import PDClient, start_worker

RIDS = ("log-done", "log-abort", "log-left")


def records(path: str) -> list[dict]:
    lines = open(path).read().splitlines()
    out = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(out) >= len(lines) - 5, lines[:20]  # a stray non-JSON line or two (native libraries)
    return out


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_every_worker_log_record_about_a_request_carries_its_id(tiny_llama4_dir):
    flags = ("--tp", "2", "--log-json")
    prefill = start_worker("prefill", tiny_llama4_dir, *flags, log_level="DEBUG", wait=False)
    decode = start_worker("decode", tiny_llama4_dir, *flags, log_level="DEBUG", wait=False)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        c = PDClient(prefill, decode)
        long = {"temperature": 0, "max_tokens": 300, "ignore_eos": True}

        async def decoding(n: int) -> None:
            while (await c.http.get(decode.url + "/load")).json()["running"] < n:
                await asyncio.sleep(0.02)

        async def run() -> None:
            # one request to its end, one the router aborts mid-stream, one whose reader leaves
            await c.generate("log-done", [5, 6, 7], {"temperature": 0, "max_tokens": 4})
            aborted = asyncio.create_task(c.generate("log-abort", [5, 6, 7, 8], long))
            left = asyncio.create_task(c.generate("log-left", [9, 6, 7, 8], long))
            await decoding(2)
            await c.abort("log-abort", "router")
            left.cancel()
            assert (await aborted)[1] == "abort"
            await asyncio.gather(left, return_exceptions=True)
        asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        prefill.stop()
        decode.stop()
    assert prefill.proc.returncode == 0 and decode.proc.returncode == 0

    recs = records(prefill.log) + records(decode.log)
    about = {rid: [r for r in recs if rid in r["message"] or r.get("request_id") == rid] for rid in RIDS}
    for rid, mine in about.items():
        for r in mine:
            assert r.get("request_id") == rid, r
        assert {r["component"] for r in mine} >= {"prefill", "decode"}, (rid, mine)
    messages = {rid: " | ".join(r["message"] for r in mine) for rid, mine in about.items()}
    assert "aborted (origin: router)" in messages["log-abort"]
    assert "stream closed before the finish" in messages["log-left"]
    assert "request log-done finished (" in messages["log-done"]
    # made by the transfer agents, also on rank 1 (a child process)
    rooms = [r for r in about["log-abort"] if r["logger"] == "pdserve.transfer.rooms"]
    assert {"decode", "decode-tp1"} <= {r["component"] for r in rooms}, about["log-abort"]
