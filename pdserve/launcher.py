"""`pdserve serve`: workers as child processes, the router in this process, one clean shutdown.

The workers (one prefill + one decode, or one colocated worker) run as ``python -m pdserve.cli
prefill|decode|worker`` on free loopback ports, each in its own process group, their output
relayed to our stderr with a name prefix (as they are with --log-json: JSON lines name their
component). Once every worker's /ready answers, the router serves here (uvicorn) and the URL is
printed to stdout. Ctrl-C or SIGTERM drains the router (new requests get 503, those in flight
get --drain-timeout seconds, the rest are stopped with an error and their rooms aborted), logs
each worker's load (its KV pool is full again: nothing leaked), then stops the workers: SIGTERM
to each process group (they drain too, with nothing left to drain), a grace period, SIGKILL for
stragglers; serve exits with 0. Each child also gets PR_SET_PDEATHSIG, so a launcher killed
outright (SIGKILL) still takes its workers along. If a worker exits during start-up, its last
lines of output are shown and serve exits with 1; if one exits while serving, the router stops
and serve exits with 1.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
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

from pdserve.frontend.cli import (add_http_flags, add_model_flags, internal_token, quiet_http_logs, resolve_model_dir,
                                  router_config)
from pdserve.frontend.config import RouterConfig
from pdserve.logs import setup_logging
from pdserve.model_name import served_name

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0   # beyond the workers' own drain timeout
POOLS_WAIT_S = 3.0    # at exit: how long the workers' aborts may take to free their blocks
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
    json_logs: bool = False   # relay JSON lines as they are (others wrapped into JSON)

    def tail_text(self) -> str:
        return "\n".join(f"    {line}" for line in self.tail) or "    (no output)"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def worker_commands(args: argparse.Namespace, model_dir: Path) -> list[tuple[str, list[str], str]]:
    """(name, command, URL) of each worker for --mode pd (prefill, decode) or colocated (one).
    The workers label their metrics with the router's served model name."""
    refused = [a for a in args.worker_arg if a.split("=", 1)[0] in MULTI_NODE_FLAGS]
    if refused:
        raise StartupError(f"--worker-arg {refused[0]}: `pdserve serve` runs every worker on this machine; "
                           "start multi-node TP groups with `pdserve prefill | decode | worker --nnodes ...`")
    name_flags = ["--served-model-name", served_name(args.model, args.served_model_name)[0]]
    roles = [("prefill", ["prefill"]), ("decode", ["decode"])] if args.mode == "pd" else \
        [("worker", ["worker", "--role", "both"])]
    head = [sys.executable, "-m", "pdserve.cli"]
    if getattr(args, "log_level", None):
        head += ["--log-level", args.log_level]
    out = []
    for name, role_args in roles:
        port = free_port()
        cmd = [*head, *role_args, "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
               "--worker-id", f"{name}-{port}", "--exit-with-parent", *name_flags, *engine_flags(args),
               *lifecycle_flags(args), *args.worker_arg]
        out.append((name, cmd, f"http://127.0.0.1:{port}"))
    return out


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in ("tp", "dtype", "device", "block_size", "kv_cache_memory", "max_num_seqs",
                 "max_num_batched_tokens", "max_model_len", "threads", "index_cache_dtype", "kernels",
                 "quantization", "host_cache_memory"):
        value = getattr(args, name, None)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if getattr(args, "prefix_cache", True) is False:
        flags.append("--no-prefix-cache")
    return flags


def plan_threads(args: argparse.Namespace) -> None:
    """Divide the cores between the workers' processes unless --threads says how many (logged)."""
    from pdserve.engine.threads import serve_threads

    plan = serve_threads(args.mode, args.tp or 1)
    if getattr(args, "threads", None) is None:
        args.threads = plan.per_process
        logger.info("CPU threads (%s): %s", args.mode, plan.describe())
    else:
        logger.info("CPU threads (%s): %d per process (--threads) × %d process(es) on %d core(s)",
                    args.mode, args.threads, plan.processes, plan.cores)


def lifecycle_flags(args: argparse.Namespace) -> list[str]:
    """The workers drain as long as the router does, and log as it does."""
    flags = []
    if getattr(args, "drain_timeout", None) is not None:
        flags += ["--drain-timeout", str(args.drain_timeout)]
    if getattr(args, "log_json", False):
        flags.append("--log-json")
    return flags


def start_child(name: str, cmd: list[str], url: str, json_logs: bool = False) -> Child:
    full = [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), *cmd]
    proc = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    child = Child(name, url, proc, json_logs=json_logs)
    if proc.stdout is None:  # cannot happen with stdout=PIPE; keeps the type checker honest
        raise RuntimeError("no pipe to the child's output")
    threading.Thread(target=_relay, args=(child, proc.stdout), name=f"relay-{name}", daemon=True).start()
    logger.info("started %s (pid %d): %s", name, proc.pid, " ".join(cmd))
    return child


def _relay(child: Child, stream: IO[bytes]) -> None:
    """Copy a child's output to our stderr, prefixed (JSON lines: as they are; other lines
    wrapped into JSON), and keep its last lines."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        child.tail.append(line)
        if not child.json_logs:
            out = f"[{child.name}] {line}"
        elif line.startswith("{"):
            out = line
        else:
            out = json.dumps({"component": child.name, "logger": "output", "message": line}, ensure_ascii=False)
        try:
            sys.stderr.write(f"{out}\n")
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


def report_pools(children: list[Child], wait_s: float = POOLS_WAIT_S) -> None:
    """Log each live worker's load once it is idle with its KV pool full again (or once `wait_s`
    passed): the record that a shutdown left no request and no block behind."""
    deadline = time.monotonic() + wait_s
    token = os.environ.get("PDSERVE_INTERNAL_TOKEN", "").strip()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    with httpx.Client(trust_env=False, timeout=2.0, headers=headers) as http:
        for child in children:
            load = None
            while child.proc.poll() is None:
                try:
                    load = http.get(f"{child.url}/load").json()
                except (httpx.HTTPError, ValueError):
                    load = None
                    break
                busy = load["waiting"] + load["running"] + load["transferring"] + load.get("in_flight", 0)
                if (not busy and load["free_blocks"] == load["total_blocks"]) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if load is None:
                logger.warning("at exit: the %s worker did not report its load", child.name)
                continue
            logger.info("at exit: %s worker: %d/%d KV blocks free, %d waiting, %d running, %d transferring, "
                        "%d in flight", child.name, load["free_blocks"], load["total_blocks"], load["waiting"],
                        load["running"], load["transferring"], load.get("in_flight", 0))


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
    from pdserve.frontend.app import create_app
    from pdserve.frontend.server import RouterServer

    quiet_http_logs()
    server = RouterServer(create_app(config), host, port)
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
    from pdserve.frontend.output import check_output_profile  # the router's own imports: only here
    from pdserve.parsers import ProfileError

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise _Interrupted(signum)

    setup_logging(args.log_json, "router")
    previous = {s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    children: list[Child] = []
    served = False
    try:
        model_dir = resolve_model_dir(args.model)
        check_output_profile(model_dir, args.tool_call_parser)  # a tokenizer the output parser cannot read: before any worker
        plan_threads(args)
        token = internal_token(args)
        if token:  # the workers read it from their environment: it never shows in `ps`
            os.environ["PDSERVE_INTERNAL_TOKEN"] = token
        for name, cmd, url in worker_commands(args, model_dir):
            children.append(start_child(name, cmd, url, args.log_json))
        wait_ready(children, args.startup_timeout)
        urls = {c.name: [c.url] for c in children}
        config = router_config(args, model_dir, urls.get("prefill", []), urls.get("decode", []),
                               urls.get("worker", []))
        served = True
        return asyncio.run(_serve_router(config, args.host, args.port, children, args.mode))
    except _Interrupted:
        logger.info("interrupted; shutting down")
        return 0
    except (StartupError, ProfileError) as e:
        logger.error("%s", e)
        print(f"pdserve: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        # Signals during the shutdown itself must not cut it short.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        if served:
            report_pools(children)
        stop_children(children, args.drain_timeout + STOP_GRACE_S)
        for s, handler in previous.items():
            signal.signal(s, handler)


# ---- flags -------------------------------------------------------------------------------------


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="router + one prefill and one decode worker on this machine",
                              description="Start the workers as child processes, wait until they are "
                                          "ready, then serve the OpenAI API.")
    add_model_flags(p)
    add_http_flags(p)
    p.add_argument("--mode", choices=("pd", "colocated"), default="pd",
                   help="pd: a prefill and a decode worker with KV transfer; colocated: one worker")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks per worker")
    e = p.add_argument_group("engine flags (passed on to the workers)")
    e.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    e.add_argument("--device", default=None, help="cpu or cuda[:N]")
    e.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    e.add_argument("--kv-cache-memory", default=None, help="KV pool size per worker, e.g. 256MiB")
    e.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    e.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per worker process (default: this machine's cores divided "
                        "between the workers' processes, at least 1 each)")
    e.add_argument("--index-cache-dtype", default=None, choices=["bfloat16", "fp8", "float32"],
                   help="DSA index keys in the KV cache (DeepSeek-V3.2/GLM-5; default bfloat16)")
    e.add_argument("--kernels", default=None, choices=["auto", "torch", "native"],
                   help="compute kernels of the workers: auto (default), torch or native")
    e.add_argument("--quantization", default=None, choices=["auto", "none", "gguf", "int8", "int4"],
                   help="weights kept quantized by the workers (default auto: the default model's GGUF "
                        "blocks on a CPU; none: fp32)")
    e.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="the workers recompute every prompt (no reuse of cached prefix blocks)")
    e.add_argument("--host-cache-memory", default=None,
                   help="host memory per worker rank for evicted cached KV blocks, e.g. 1GiB")
    e.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every worker command line (repeatable), "
                        "e.g. --worker-arg=--health-stall-timeout=30")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds to wait for the workers to be ready")
    for flag in MULTI_NODE_FLAGS:
        p.add_argument(flag, action=_WorkersOnly, help=argparse.SUPPRESS)
    p.set_defaults(func=serve)
    return p


MULTI_NODE_FLAGS = ("--nnodes", "--node-rank", "--dist-init-addr")


class _WorkersOnly(argparse.Action):
    """A multi-node flag given to `serve`: refused with a message that says where it belongs."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is a flag of `pdserve prefill | decode | worker`: `pdserve serve` runs "
                     "every worker on this machine; start each node of a multi-node TP group with those "
                     "commands (README: Tensor parallelism, Several machines)")


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.launcher FLAGS` runs `pdserve serve FLAGS`."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.launcher")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    setup_logging(args.log_json, "router", logging.INFO)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
