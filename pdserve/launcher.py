"""`pdserve serve`: workers as child processes, the router in this process, one clean shutdown.

The workers (one prefill + one decode, or one colocated worker) run as ``python -m pdserve.cli
prefill|decode|worker`` on free loopback ports, each in its own process group, their output
relayed to our stderr with a name prefix (as they are with --log-json: JSON lines name their
component). The router's port is bound before the first worker starts and held (as each worker
holds its own), so no worker or TP rendezvous picks it as a free port meanwhile. Once every
worker's /ready answers, the router serves there (uvicorn) and the URL is printed to stdout.
Ctrl-C or SIGTERM drains the router (new requests get 503, those in flight get --drain-timeout
seconds, the rest are stopped with an error and their rooms aborted), logs each worker's load
(its KV pool is full again: nothing leaked), then stops the workers: SIGTERM to each process
group (they drain too, with nothing left to drain), a grace period, SIGKILL for stragglers;
serve exits with 0. Each child also gets PR_SET_PDEATHSIG, so a launcher killed outright
(SIGKILL) still takes its workers along. If a worker exits during start-up, its last lines of
output are shown and serve exits with 1 (a configuration that cannot work is refused before any
worker starts, in one line, exit 2: pdserve.preflight).

While serving, `serve` supervises its workers (pdserve.supervisor, docs/supervision.md): a
worker that exits is restarted whole (a new process group, the same port, a new worker id)
after a delay that doubles while it keeps failing, and the router takes it back into rotation
when it answers again; requests that need it wait in the admission queue meanwhile. Once no
process of the dead worker is left (`end_group`), its peers are told through the router, and
fail the rooms they shared with it at once (their KV blocks come back). A crash
loop ends serve with the worker's last error as one line (exit 1); the router drains first, so
every stream ends with [DONE] or an error event.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING

import httpx

from pdserve.frontend.cli import (add_http_flags, add_model_flags, internal_token, quiet_http_logs, resolve_model_dir,
                                  router_config)
from pdserve.frontend.config import RouterConfig
from pdserve.logs import setup_logging
from pdserve.model_name import served_name
from pdserve.ports import free_port
from pdserve.preflight import ConfigError, Settings, bind_port, check, parse_size
from pdserve.supervisor import History, RestartPolicy, Supervision, decide, describe_exit, last_error

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0   # beyond the workers' own drain timeout
READY_POLL_S = 0.05   # start-up: a refused connection costs next to nothing; serve sooner
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


SUPERVISE_TICK_S = 1.0  # exits wake the supervisor at once; this only bounds a missed wake-up


@dataclass
class Slot:
    """One supervised worker: its command, its process now, its restarts."""

    child: Child
    cmd: list[str]
    on_exit: Callable[[], None] | None = None  # wakes the supervisor the moment the worker exits
    started_at: float = field(default_factory=time.monotonic)
    history: History = field(default_factory=History)
    restart_at: float | None = None   # a restart is due then (None: none pending)

    @property
    def name(self) -> str:
        return self.child.name

    def restart(self) -> None:
        """The same command with a new worker id (its peers must not take it for the old one,
        whose rooms and transfers died with it); a fresh process group, so fresh ranks."""
        _signal_group(self.child, signal.SIGKILL)  # ranks the dead worker left behind, if any
        self.restart_at = None
        cmd = list(self.cmd)
        if "--worker-id" in cmd:
            i = cmd.index("--worker-id") + 1
            cmd[i] = f"{self.cmd[i]}-r{self.history.restarts}"
        self.child = start_child(self.child.name, cmd, self.child.url, self.child.json_logs, self.on_exit)
        self.started_at = time.monotonic()


@dataclass(frozen=True)
class Verdict:
    """Supervision ends serve: the exit code and the one line that says why."""

    code: int
    line: str


def supervise(slots: list[Slot], s: Supervision, now: float,
              on_down: Callable[[str, bool], None] = lambda url, back: None,
              on_dead: Callable[[str, str], object] = lambda url, why: None) -> Verdict | None:
    """One look at every worker: restart those due, decide about those that exited. `on_down(url,
    coming_back)` tells the router a worker is down and whether it will be back; `on_dead(url,
    why)`, once no rank of it is left, that its peers may fail the rooms they share with it."""
    for slot in slots:
        if slot.restart_at is not None:
            if now >= slot.restart_at:
                slot.restart()
            continue
        code = slot.child.proc.poll()
        if code is None:
            continue
        time.sleep(0.05)  # let the relay catch its last lines
        error = last_error(slot.child.tail) or f"the {slot.name} worker {describe_exit(code)}"
        if end_group(slot.child):  # every rank is gone: nothing of it can write a peer's blocks any more
            on_dead(slot.child.url, f"the {slot.name} worker {describe_exit(code)}")
        decision = decide(s, code, slot.started_at, now, slot.history)
        if decision.restart:
            logger.error("the %s worker %s; restarting it in %.1f s (restart %d). Its last output:\n%s",
                         slot.name, describe_exit(code), decision.delay_s, slot.history.restarts,
                         slot.child.tail_text())
            slot.restart_at = now + decision.delay_s
            on_down(slot.child.url, True)
            continue
        on_down(slot.child.url, False)
        logger.error("the %s worker %s; its last output:\n%s", slot.name, describe_exit(code), slot.child.tail_text())
        if decision.crash_loop:
            return Verdict(1, f"the {slot.name} worker keeps failing ({s.max_restarts + 1} exits within "
                              f"{s.window_s:g} s); giving up. Its last error: {error}")
        return Verdict(1 if code else 0, f"the {slot.name} worker {describe_exit(code)} and is not restarted "
                                         f"(--restart {s.policy.value}): {error}")
    return None


def worker_counts(args: argparse.Namespace) -> dict[str, int]:
    """How many workers of each kind serve starts: --prefill-workers and --decode-workers in PD
    mode, --workers colocated (1 each by default); a count for the other mode is refused."""
    pd = args.mode == "pd"
    wrong = ("--workers" if pd and getattr(args, "workers", None) is not None else
             "--prefill-workers" if not pd and getattr(args, "prefill_workers", None) is not None else
             "--decode-workers" if not pd and getattr(args, "decode_workers", None) is not None else None)
    if wrong:
        raise StartupError(f"{wrong} does not apply to --mode {args.mode}: use "
                           + ("--prefill-workers N --decode-workers M" if pd else "--workers N"))
    counts = ({"prefill": getattr(args, "prefill_workers", None) or 1,
               "decode": getattr(args, "decode_workers", None) or 1} if pd
              else {"worker": getattr(args, "workers", None) or 1})
    if min(counts.values()) < 1:
        raise StartupError("worker counts must be >= 1")
    return counts


def worker_commands(args: argparse.Namespace, model_dir: Path) -> list[tuple[str, list[str], str]]:
    """(name, command, URL) of each worker for --mode pd (prefill and decode workers) or
    colocated, as many as `worker_counts` says. A worker alone in its role is named by the role
    ("prefill", "decode", "worker"), several are numbered ("prefill-1", "prefill-2"); `role_urls`
    reads the role back. The workers label their metrics with the router's served model name."""
    refused = [a for a in args.worker_arg if a.split("=", 1)[0] in MULTI_NODE_FLAGS]
    if refused:
        raise StartupError(f"--worker-arg {refused[0]}: `pdserve serve` runs every worker on this machine; "
                           "start multi-node TP groups with `pdserve prefill | decode | worker --nnodes ...`")
    name_flags = ["--served-model-name", served_name(args.model, args.served_model_name)[0]]
    role_args = {"prefill": ["prefill"], "decode": ["decode"], "worker": ["worker", "--role", "both"]}
    head = [sys.executable, "-m", "pdserve.cli"]
    if getattr(args, "log_level", None):
        head += ["--log-level", args.log_level]
    out: list[tuple[str, list[str], str]] = []
    ports: set[int] = set()
    for role, count in worker_counts(args).items():
        for i in range(1, count + 1):
            name = role if count == 1 else f"{role}-{i}"
            port = free_port()
            while port in ports:  # the OS may hand a just-released port out again
                port = free_port()
            ports.add(port)
            cmd = [*head, *role_args[role], "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                   "--worker-id", f"{name}-{port}", "--exit-with-parent", *name_flags, *engine_flags(args),
                   *lifecycle_flags(args), *args.worker_arg]
            out.append((name, cmd, f"http://127.0.0.1:{port}"))
    return out


def role_urls(named: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """(name, URL) of the workers → URLs by role ("prefill", "decode", "worker"), for the router."""
    urls: dict[str, list[str]] = {}
    for name, url in named:
        urls.setdefault(name.split("-", 1)[0], []).append(url)
    return urls


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in ("tp", "dtype", "device", "block_size", "kv_cache_memory", "max_num_seqs",
                 "max_num_batched_tokens", "max_prefill_tokens", "first_token_slack", "max_model_len", "threads",
                 "index_cache_dtype", "kv_cache_dtype", "kernels", "quantization", "host_cache_memory",
                 "follow_up_wait_ms"):
        value = getattr(args, name, None)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if getattr(args, "prefix_cache", True) is False:
        flags.append("--no-prefix-cache")
    if getattr(args, "overlap", None) is not None:
        flags.append("--overlap" if args.overlap else "--no-overlap")
    if getattr(args, "cuda_graphs", True) is False:
        flags.append("--no-cuda-graphs")
    return flags


def plan_threads(args: argparse.Namespace) -> None:
    """Threads per worker process (engine/threads.py) unless --threads says how many (logged)."""
    from pdserve.engine.threads import serve_threads

    plan = serve_threads(args.mode, args.tp or 1, workers=sum(worker_counts(args).values()),
                         native=getattr(args, "kernels", None) != "torch")
    if getattr(args, "threads", None) is None:
        args.threads = plan.per_process
        log = logger.warning if plan.oversubscribed else logger.info
        log("CPU threads (%s): %s", args.mode, plan.describe())
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


def start_child(name: str, cmd: list[str], url: str, json_logs: bool = False,
                on_exit: Callable[[], None] | None = None) -> Child:
    """Start a worker command; `on_exit` runs (in a thread) the moment it exits."""
    full = [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), *cmd]
    proc = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    child = Child(name, url, proc, json_logs=json_logs)
    if proc.stdout is None:  # cannot happen with stdout=PIPE; keeps the type checker honest
        raise RuntimeError("no pipe to the child's output")
    threading.Thread(target=_relay, args=(child, proc.stdout), name=f"relay-{name}", daemon=True).start()
    if on_exit is not None:
        threading.Thread(target=lambda: (proc.wait(), on_exit()), name=f"wait-{name}", daemon=True).start()
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
                time.sleep(READY_POLL_S)


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


GROUP_GONE_S = 2.0  # how long a SIGKILLed rank may take to be gone (it never blocks in the kernel that long)


def end_group(child: Child, timeout_s: float = GROUP_GONE_S) -> bool:
    """Its rank 0 exited: SIGKILL the ranks left in its process group and wait until none is
    alive (a zombie writes nothing). True once the group is empty: proof that no process of
    that worker can touch a peer's KV blocks any more."""
    _signal_group(child, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while True:
        alive = group_members(child.proc.pid)
        if not alive:
            return True
        if time.monotonic() > deadline:
            logger.warning("the %s worker's ranks %s outlived SIGKILL for %.1f s; its peers are not told it died",
                           child.name, alive, timeout_s)
            return False
        time.sleep(0.01)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`, from /proc (elsewhere: the
    group, as one, while the kernel still knows it)."""
    if not Path("/proc/self/stat").exists():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except ProcessLookupError:
            return []
        except PermissionError:
            return [pgid]
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it exited meanwhile
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(stat.parent.name))
    return out


def _signal_group(child: Child, sig: signal.Signals) -> None:
    try:
        os.killpg(child.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def _serve_router(app: FastAPI, sock: socket.socket, host: str, port: int, slots: list[Slot], mode: str,
                        supervision: Supervision) -> Verdict | None:
    from pdserve.frontend.server import RouterServer

    quiet_http_logs()
    server = RouterServer(app, host, port)
    config: RouterConfig = server.router.config
    pool = server.router.pool
    if supervision.policy is not RestartPolicy.NEVER:
        # every worker here comes back when it dies (or serve ends): a request that finds its
        # role missing waits in the admission queue, even while the dead process is still exiting
        pool.orchestrated = {w.role for w in pool.workers}
    task = asyncio.create_task(server.serve(sockets=[sock]))
    # A worker's exit wakes the supervisor at once: the router takes it out of rotation before
    # the next request is sent to its closed port (a probe would see it up to an interval later).
    loop, exited = asyncio.get_running_loop(), asyncio.Event()

    def wake() -> None:  # runs in a waiter thread, maybe after serve's loop has closed
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(exited.set)

    for slot in slots:
        slot.on_exit = wake
        if slot.child.proc.poll() is None:
            threading.Thread(target=lambda p=slot.child.proc, f=slot.on_exit: (p.wait(), f()), daemon=True).start()
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(f"pdserve: serving {config.served_model_name} ({mode}) at http://{host}:{port}/v1", flush=True)
    verdict = None
    while not task.done():
        exited.clear()
        verdict = supervise(slots, supervision, time.monotonic(), pool.expect_back, pool.peer_dead)
        if verdict is not None:
            # the router drains as on SIGTERM: every stream ends with [DONE] or an error event
            server.handle_exit(signal.SIGTERM, None)
            break
        due = [slot.restart_at for slot in slots if slot.restart_at is not None]
        wait_s = SUPERVISE_TICK_S if not due else max(0.0, min(min(due) - time.monotonic(), SUPERVISE_TICK_S))
        woke = asyncio.ensure_future(exited.wait())
        await asyncio.wait({task, woke}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        woke.cancel()
    await task
    return verdict


def preflight(args: argparse.Namespace, model_dir: Path) -> None:
    """The start-up checks of pdserve.preflight on serve's flags (ConfigError); the router's
    port is checked too (its workers get free ports)."""
    memory = parse_size(args.kv_cache_memory) if getattr(args, "kv_cache_memory", None) else None
    check(Settings(model=str(model_dir), tp=args.tp or 1, host=args.host, port=args.port, kv_cache_memory=memory,
                   max_model_len=getattr(args, "max_model_len", None), block_size=args.block_size or 16,
                   dtype=args.dtype or "auto", device=args.device or "cpu"))


def supervision(args: argparse.Namespace) -> Supervision:
    return Supervision(RestartPolicy(args.restart), max_restarts=args.restart_max, window_s=args.restart_window,
                       backoff_s=args.restart_backoff)


def serve(args: argparse.Namespace) -> int:
    from pdserve.frontend.app import create_app  # the router's own imports: only here
    from pdserve.frontend.output import check_output_profile
    from pdserve.parsers import ProfileError
    from pdserve.tokenizer import Tokenizer

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise _Interrupted(signum)

    setup_logging(args.log_json, "router")
    previous = {s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    slots: list[Slot] = []
    served = False
    verdict: Verdict | None = None
    try:
        model_dir = resolve_model_dir(args.model)
        preflight(args, model_dir)
        # The router's port, held from now on: the workers and their TP rendezvous pick free ports
        # from the same range while they start, and one of them could take it before the router
        # listens (it happened in a test run: the prefill worker got the router's port).
        router_socket = bind_port(args.host, args.port)
        tokenizer = Tokenizer(model_dir)  # loaded once (~1 s): for this check and for the router
        check_output_profile(model_dir, args.tool_call_parser, tokenizer)  # an unreadable output: before any worker
        plan_threads(args)
        token = internal_token(args)
        if token:  # the workers read it from their environment: it never shows in `ps`
            os.environ["PDSERVE_INTERNAL_TOKEN"] = token
        if (args.tp or 1) > 1:  # idle TP ranks without gloo's 10 ms tick (pdserve.gloo_idle)
            from pdserve.gloo_idle import preload_env
            os.environ.update(preload_env())
        for name, cmd, url in worker_commands(args, model_dir):
            slots.append(Slot(start_child(name, cmd, url, args.log_json), cmd))
        urls = role_urls((slot.name, slot.child.url) for slot in slots)
        config = router_config(args, model_dir, urls.get("prefill", []), urls.get("decode", []),
                               urls.get("worker", []))
        app = create_app(config, tokenizer)  # while the workers load: the router needs them only to serve
        wait_ready([slot.child for slot in slots], args.startup_timeout)
        served = True
        verdict = asyncio.run(_serve_router(app, router_socket, args.host, args.port, slots, args.mode,
                                            supervision(args)))
        return 0 if verdict is None else verdict.code
    except _Interrupted:
        logger.info("interrupted; shutting down")
        return 0
    except ConfigError as e:
        print(f"pdserve serve: error: {e}", file=sys.stderr, flush=True)
        return 2
    except (StartupError, ProfileError) as e:
        logger.error("%s", e)
        print(f"pdserve: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        # Signals during the shutdown itself must not cut it short.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        children = [slot.child for slot in slots]
        if served:
            report_pools(children)
        stop_children(children, args.drain_timeout + STOP_GRACE_S)
        if verdict is not None:  # last, after the logs of the shutdown: the one line that says why
            print(f"pdserve: {verdict.line}", file=sys.stderr, flush=True)
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
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="colocated mode: start N workers (default 1); the router sends each request to "
                        "the one most likely to hold its prompt's prefix (--routing)")
    p.add_argument("--prefill-workers", type=int, default=None, metavar="N",
                   help="pd mode: start N prefill workers (default 1)")
    p.add_argument("--decode-workers", type=int, default=None, metavar="M",
                   help="pd mode: start M decode workers (default 1)")
    e = p.add_argument_group("engine flags (passed on to the workers)")
    e.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    e.add_argument("--device", default=None, help="cpu or cuda[:N]")
    e.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    e.add_argument("--kv-cache-memory", default=None, help="KV pool size per worker, e.g. 256MiB")
    e.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    e.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="prompt tokens a step computes beside a token it samples (default: 256 on a CPU; "
                        "docs/step-budget.md)")
    e.add_argument("--first-token-slack", type=int, default=None,
                   help="prompt tokens a step takes for other prompts once it computes a prompt's last "
                        "chunk (default: 16 on a CPU; docs/step-budget.md)")
    e.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per worker process (default: this machine's cores divided "
                        "between the workers' processes, at least 1 each; PD's two workers on the native "
                        "kernels each get every core: docs/cpu-threads.md)")
    e.add_argument("--index-cache-dtype", default=None, choices=["bfloat16", "fp8", "float32"],
                   help="DSA index keys in the KV cache (DeepSeek-V3.2/GLM-5; default bfloat16)")
    e.add_argument("--kv-cache-dtype", default=None, choices=["auto", "float32", "float16"],
                   help="K/V in the workers' KV caches: auto (default: the compute dtype) or float16 on "
                        "a CPU (docs/kv-cache-dtype.md)")
    e.add_argument("--kernels", default=None, choices=["auto", "torch", "native"],
                   help="compute kernels of the workers: auto (default), torch or native")
    e.add_argument("--quantization", default=None, choices=["auto", "none", "gguf", "int8", "int4"],
                   help="weights kept quantized by the workers (default auto: the default model's GGUF "
                        "blocks on a CPU; none: fp32)")
    e.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="the workers recompute every prompt (no reuse of cached prefix blocks)")
    e.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="the workers plan the next step while the forward runs (docs/overlap.md)")
    e.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="the GPU workers run every step op by op (no CUDA graphs; docs/gpu.md)")
    e.add_argument("--host-cache-memory", default=None,
                   help="host memory per worker rank for evicted cached KV blocks, e.g. 1GiB")
    e.add_argument("--follow-up-wait-ms", type=float, default=None, metavar="MS",
                   help="the workers wait up to MS after an answer for the conversation's next turn "
                        "before a step of decodes alone (default: 20 on a CPU, 0 on a GPU; docs/follow-ups.md)")
    e.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every worker command line (repeatable), "
                        "e.g. --worker-arg=--health-stall-timeout=30")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds to wait for the workers to be ready")
    r = p.add_argument_group("supervision (docs/supervision.md)")
    r.add_argument("--restart", choices=[x.value for x in RestartPolicy], default=RestartPolicy.ON_FAILURE.value,
                   help="restart a worker that exits: always, on-failure (non-zero exit or a signal; the "
                        "default) or never (serve stops)")
    r.add_argument("--restart-max", type=int, default=5, metavar="N",
                   help="more than N exits of one worker within --restart-window is a crash loop: serve "
                        "stops with the worker's last error (default 5)")
    r.add_argument("--restart-window", type=float, default=60.0, metavar="S", help="see --restart-max (60 s)")
    r.add_argument("--restart-backoff", type=float, default=0.5, metavar="S",
                   help="the first restart's delay; it doubles while the worker keeps failing, up to 30 s")
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
