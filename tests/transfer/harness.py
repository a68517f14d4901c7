"""Transfer agents in their own processes, driven over a pipe by the test (which plays router).

Each worker process owns one NixlTarget or NixlSource and a small pool, polls it in a loop
(unless paused) and answers commands between polls. Events come back with wall-clock
timestamps, comparable across processes on one host, so tests can measure latencies.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

TIMEOUT_S = 20.0


@dataclass(frozen=True)
class PoolSpec:
    num_tensors: int = 4
    num_blocks: int = 16
    block_shape: tuple[int, ...] = (4, 2, 32)  # e.g. tokens, kv heads, head dim
    dtype: str = "float16"

    def make(self, seed: int | None) -> list[Any]:
        import torch

        dtype = getattr(torch, self.dtype)
        shape = (self.num_blocks, *self.block_shape)
        if seed is None:
            return [torch.zeros(shape, dtype=dtype) for _ in range(self.num_tensors)]
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(shape, generator=g).to(dtype) for _ in range(self.num_tensors)]


def block_bytes(pool: list[Any], blocks: list[int]) -> bytes:
    """The bytes of `blocks` in every tensor of `pool`, tensor-major."""
    return b"".join(t[b].contiguous().view(-1).numpy().tobytes() for t in pool for b in blocks)


def expected_bytes(spec: PoolSpec, seed: int, blocks: list[int]) -> bytes:
    return block_bytes(spec.make(seed), blocks)


@dataclass
class _Worker:
    role: str
    agent: Any
    pool: list[Any]
    polling: bool = True
    events: list[tuple[float, Any]] = field(default_factory=list)
    blocks: dict[str, list[int]] = field(default_factory=dict)
    snapshots: dict[str, bytes] = field(default_factory=dict)

    def poll(self) -> None:
        for ev in self.agent.poll():
            now = time.time()
            if type(ev).__name__ == "RoomDone" and ev.room in self.blocks:
                # Taken in the iteration that saw the completion: the data must be there.
                self.snapshots[ev.room] = block_bytes(self.pool, self.blocks[ev.room])
            self.events.append((now, ev))

    def command(self, cmd: str, args: tuple[Any, ...]) -> Any:
        a = self.agent
        if cmd == "expect":
            room, source, blocks = args
            self.blocks[room] = list(blocks)
            return a.expect(room, source)
        if cmd == "write":
            return a.write(*args)
        if cmd == "connect":
            try:
                return a.connect(*args)
            except Exception as e:  # returned to the test as a value
                return ("error", type(e).__name__, str(e))
        if cmd == "abort":
            return a.abort(*args)
        if cmd == "forget":
            return a.forget_peer(*args)
        if cmd == "events":
            out, self.events = self.events, []
            return out
        if cmd == "pause":
            self.polling = not args[0]
            return None
        if cmd == "blocks":
            return block_bytes(self.pool, list(args[0]))
        if cmd == "snapshot":
            return self.snapshots.get(args[0])
        if cmd == "state":
            return a.state(args[0]).value
        if cmd == "metrics":
            return a.metrics()
        raise ValueError(f"unknown command {cmd}")


def serve(role: str, name: str, spec: PoolSpec, seed: int | None, config: dict[str, Any],
          conn: Connection) -> None:
    """Worker process main: build the agent, report ready, then poll and answer commands."""
    from pdserve.transfer.base import TransferConfig

    pool = spec.make(seed)
    if role == "target":
        from pdserve.transfer.nixl_target import NixlTarget as cls
    else:
        from pdserve.transfer.nixl_source import NixlSource as cls  # type: ignore[assignment]
    agent = cls(name, pool, TransferConfig(**config))
    w = _Worker(role, agent, pool)
    conn.send(("ready", agent.bootstrap_info() if role == "target" else None))
    while True:
        if conn.poll(0 if w.polling else 0.01):
            cmd, args = conn.recv()
            if cmd == "stop":
                agent.close()
                conn.send(None)
                return
            try:
                conn.send(("ok", w.command(cmd, args)))
            except Exception:
                conn.send(("exc", traceback.format_exc()))
        if w.polling:
            w.poll()
            time.sleep(0.0005)


def _context() -> mp.context.BaseContext:
    """Fork server with torch and NIXL preloaded: a worker starts in well under a second
    instead of re-importing torch (the server itself is single-threaded, so forking is safe)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "nixl._api", "pdserve.transfer.nixl_source",
                                "pdserve.transfer.nixl_target", __name__])
    return ctx


class Agent:
    """The test's handle on one worker process."""

    def __init__(self, role: str, name: str, spec: PoolSpec = PoolSpec(),
                 seed: int | None = None, **config: Any):
        # The child unpickles `serve` by this module's name; spawn gives it our sys.path.
        package_root = str(Path(__file__).resolve().parents[len(__name__.split(".")) - 1])
        if package_root not in sys.path:
            sys.path.insert(0, package_root)
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.role, self.name, self.spec = role, name, spec
        self.proc = ctx.Process(target=serve, args=(role, name, spec, seed, config, child),
                                daemon=True, name=f"{role}:{name}")
        self.proc.start()
        child.close()
        self.info: bytes | None = None
        self.seen: list[tuple[float, Any]] = []

    def ready(self, timeout: float = 60.0) -> Agent:
        """Wait until the agent is built (processes start in parallel; the wait is separate)."""
        if not self.conn.poll(timeout):
            self.kill()
            raise TimeoutError(f"{self.name} did not start")
        _, self.info = self.conn.recv()
        return self

    def call(self, cmd: str, *args: Any, timeout: float = TIMEOUT_S) -> Any:
        self.conn.send((cmd, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer to {cmd}")
        status, value = self.conn.recv()
        if status == "exc":
            raise RuntimeError(f"{self.name} failed on {cmd}:\n{value}")
        return value

    def drain(self) -> list[tuple[float, Any]]:
        got = self.call("events")
        self.seen.extend(got)
        return got

    def mark(self) -> int:
        """A position in the events seen so far, for `wait_for(..., since=mark)`."""
        self.drain()
        return len(self.seen)

    def wait_for(self, pred: Callable[[Any], bool], timeout: float = 5.0,
                 since: int = 0) -> tuple[float, Any]:
        """First event (timestamp, event) matching `pred` among those seen from `since` on,
        waiting up to `timeout` for it."""
        deadline = time.monotonic() + timeout
        checked = since
        while True:
            for ts, ev in self.seen[checked:]:
                if pred(ev):
                    return ts, ev
            checked = len(self.seen)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no matching event in {timeout}s; "
                                   f"saw {[e for _, e in self.seen]}")
            self.drain()
            time.sleep(0.005)

    def events_of(self, room: str) -> list[Any]:
        self.drain()
        return [ev for _, ev in self.seen if getattr(ev, "room", None) == room]

    def kill(self) -> float:
        """SIGKILL the process; returns the wall time of the kill."""
        t = time.time()
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        return t

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", ()))
                self.conn.poll(5)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(5)
        self.kill()


def kind(name: str, room: str | None = None) -> Callable[[Any], bool]:
    """Event predicate: events of type `name` (and of `room`, if given)."""
    return lambda ev: type(ev).__name__ == name and (room is None or ev.room == room)
