"""Measure KV writes between two processes (not a test; speed is reported, not asserted).

    UCX_NET_DEVICES=lo .venv/bin/python tests/transfer/measure_transfer.py

A SmolLM2-135M-shaped pool: 30 layers x (K, V) = 60 tensors, blocks of 16 tokens x 3 KV heads
x 64 dims in fp16 (6 KiB per tensor block). Reports write() -> RoomDone at the target and
write() -> RoomWritten at the source, against an in-process copy of the same blocks.
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("UCX_NET_DEVICES", "lo")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transfer.harness import Agent, PoolSpec, kind  # noqa: E402

SPEC = PoolSpec(num_tensors=60, num_blocks=512, block_shape=(16, 3, 64), dtype="float16")


_POOLS: list = []


def memcpy_ms(n_blocks: int, scattered: bool) -> float:
    """Median of 7 in-process copies of the same blocks (pools allocated and touched once)."""
    import torch

    if not _POOLS:
        _POOLS.extend([SPEC.make(1), [t.fill_(1.0) for t in SPEC.make(None)]])
    src, dst = _POOLS
    times = []
    for _ in range(7):
        idx = torch.tensor(random.sample(range(SPEC.num_blocks), n_blocks) if scattered
                           else list(range(n_blocks)))
        t0 = time.perf_counter()
        for s, d in zip(src, dst):
            d[idx] = s[idx]
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> None:
    target = Agent("target", "pdserve-decode-bench-tp0", SPEC)
    source = Agent("source", "pdserve-prefill-bench-tp0", SPEC, seed=1)
    target.ready()
    source.ready()
    t0 = time.perf_counter()
    source.call("connect", target.info)
    target.wait_for(kind("PeerConnected"))
    print(f"connect (incl. remote descriptor list of {60 * 512} blocks): "
          f"{1e3 * (time.perf_counter() - t0):.1f} ms")
    room = 0
    for n in (1, 8, 64, 256):
        for scattered in (False, True):
            done, written = [], []
            for _ in range(7):
                room += 1
                blocks = (random.sample(range(SPEC.num_blocks), n) if scattered
                          else list(range(n)))
                target.call("expect", f"b{room}", source.name, blocks)
                t_call = time.time()
                source.call("write", f"b{room}", target.name, blocks, blocks, b"tok")
                ts_done, _ = target.wait_for(kind("RoomDone", f"b{room}"), timeout=30)
                ts_written, _ = source.wait_for(kind("RoomWritten", f"b{room}"), timeout=30)
                done.append(1e3 * (ts_done - t_call))
                written.append(1e3 * (ts_written - t_call))
            mib = n * 60 * 6 / 1024
            print(f"{n:4d} blocks x 60 tensors ({mib:6.1f} MiB, "
                  f"{'scattered' if scattered else 'in order '}): "
                  f"RoomDone {statistics.median(done):7.2f} ms, "
                  f"RoomWritten {statistics.median(written):7.2f} ms, "
                  f"memcpy {memcpy_ms(n, scattered):6.2f} ms (median of 7)")
    target.stop()
    source.stop()


if __name__ == "__main__":
    main()
