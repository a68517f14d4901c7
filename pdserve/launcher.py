"""`pdserve serve`: workers as child processes, the router in this process, one clean shutdown.

The workers (one prefill + one decode, or one colocated worker) run as ``python -m pdserve.cli
prefill|decode|worker`` on free loopback ports, each in its own process group, their output
relayed to our stderr with a name prefix. Once every worker's /ready answers, the router serves
here (uvicorn) and the URL is printed to stdout. Ctrl-C or SIGTERM stops the router, then the
workers: SIGTERM to each process group, a grace period, SIGKILL for stragglers. Each child also
gets PR_SET_PDEATHSIG, so a launcher killed outright (SIGKILL) still takes its workers along.
If a worker exits during start-up, its last lines of output are shown and serve exits with 1;
if one exits while serving, the router stops and serve exits with 1.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

import httpx

from pdserve.frontend.cli import quiet_http_logs, resolve_model_dir, router_config
from pdserve.frontend.config import RouterConfig

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
TAIL_LINES = 40
# Runs in the child before the worker: die with the launcher (Linux), then exec the worker.
_TRAMPOLINE = """\
import ctypes, os, signal, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass
if os.getppid() != parent:
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


class StartupError(Exception):
    pass


class _Interrupted(BaseException):
    """SIGINT/SIGTERM outside uvicorn's own handling: unwind, then stop the workers."""


@dataclass
class Child:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))

    def tail_text(self) -> str:
        return "\n".join(f"    {line}" for line in self.tail) or "    (no output)"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def worker_commands(args: argparse.Namespace, model_dir: Path) -> list[tuple[str, list[str], str]]:
    """(name, command, URL) of each worker for --mode pd (prefill, decode) or colocated (one)."""
    roles = [("prefill", ["prefill"]), ("decode", ["decode"])] if args.mode == "pd" else \
        [("worker", ["worker", "--role", "both"])]
    head = [sys.executable, "-m", "pdserve.cli"]
    if getattr(args, "log_level", None):
        head += ["--log-level", args.log_level]
    out = []
    for name, role_args in roles:
        port = free_port()
        cmd = [*head, *role_args, "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
               "--worker-id", f"{name}-{port}", "--exit-with-parent", *engine_flags(args), *args.worker_arg]
        out.append((name, cmd, f"http://127.0.0.1:{port}"))
    return out


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in ("tp", "dtype", "device", "block_size", "kv_cache_memory", "max_num_seqs",
                 "max_num_batched_tokens", "max_model_len", "threads"):
        value = getattr(args, name, None)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def start_child(name: str, cmd: list[str], url: str) -> Child:
    full = [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), *cmd]
    proc = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    child = Child(name, url, proc)
    if proc.stdout is None:  # cannot happen with stdout=PIPE; keeps the type checker honest
        raise RuntimeError("no pipe to the child's output")
    threading.Thread(target=_relay, args=(child, proc.stdout), name=f"relay-{name}", daemon=True).start()
    logger.info("started %s (pid %d): %s", name, proc.pid, " ".join(cmd))
    return child


def _relay(child: Child, stream: IO[bytes]) -> None:
    """Copy a child's output to our stderr, prefixed, and keep its last lines."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        child.tail.append(line)
        try:
            sys.stderr.write(f"[{child.name}] {line}\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # our stderr is gone; keep draining the pipe
            pass
    stream.close()


def wait_ready(children: list[Child], timeout_s: float) -> None:
    """Until every child's /ready says ready; StartupError if one exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    waiting = list(children)
    with httpx.Client(trust_env=False, timeout=2.0) as http:
        while waiting:
            for child in list(waiting):
                code = child.proc.poll()
                if code is not None:
                    time.sleep(0.2)  # let the relay catch the last lines
                    raise StartupError(f"the {child.name} worker exited with code {code} during start-up; "
                                       f"its last output:\n{child.tail_text()}")
                try:
                    ready = http.get(f"{child.url}/ready").status_code == 200
                except httpx.HTTPError:
                    ready = False
                if ready:
                    logger.info("%s worker ready at %s", child.name, child.url)
                    waiting.remove(child)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(c.name for c in waiting)
                raise StartupError(f"worker(s) {names} not ready after {timeout_s:.0f} s; last output:\n"
                                   + "\n".join(c.tail_text() for c in waiting))
            if waiting:
                time.sleep(0.25)


def stop_children(children: list[Child], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every child's process group, wait up to `grace_s`, SIGKILL what is left."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s worker (pid %d) did not stop in %.0f s; killing it", child.name,
                           child.proc.pid, grace_s)
    for child in children:
        _signal_group(child, signal.SIGKILL)  # the group may hold ranks the worker started
        try:
            child.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("%s worker (pid %d) survived SIGKILL", child.name, child.proc.pid)


def _signal_group(child: Child, sig: signal.Signals) -> None:
    try:
        os.killpg(child.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def _serve_router(config: RouterConfig, host: str, port: int, children: list[Child], mode: str) -> int:
    import uvicorn

    from pdserve.frontend.app import create_app

    quiet_http_logs()
    server = uvicorn.Server(uvicorn.Config(create_app(config), host=host, port=port, access_log=False,
                                           log_level="warning", timeout_graceful_shutdown=5))
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(f"pdserve: serving {config.served_model_name} ({mode}) at http://{host}:{port}/v1", flush=True)
    code = 0
    while not task.done():
        dead = [c for c in children if c.proc.poll() is not None]
        if dead:
            for c in dead:
                logger.error("the %s worker exited with code %s; stopping. Its last output:\n%s",
                             c.name, c.proc.returncode, c.tail_text())
            server.should_exit = True
            code = 1
            break
        await asyncio.wait({task}, timeout=0.5)
    await task
    return code


def serve(args: argparse.Namespace) -> int:
    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise _Interrupted(signum)

    previous = {s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    children: list[Child] = []
    try:
        model_dir = resolve_model_dir(args.model)
        for name, cmd, url in worker_commands(args, model_dir):
            children.append(start_child(name, cmd, url))
        wait_ready(children, args.startup_timeout)
        urls = {c.name: [c.url] for c in children}
        config = router_config(args, model_dir, urls.get("prefill", []), urls.get("decode", []),
                               urls.get("worker", []))
        return asyncio.run(_serve_router(config, args.host, args.port, children, args.mode))
    except _Interrupted:
        logger.info("interrupted; shutting down")
        return 0
    except StartupError as e:
        logger.error("%s", e)
        print(f"pdserve: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        # Signals during the shutdown itself must not cut it short.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        stop_children(children)
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.launcher FLAGS` runs `pdserve serve FLAGS`."""
    from pdserve.frontend.cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="python -m pdserve.launcher")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
