"""Servers that bench/serve.py starts itself: free port, wait for /health, read /metrics, SIGTERM."""
from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.ports import free_port


def _argv(command: str, port_flag: str, port: int) -> list[str]:
    """The command's words with `--port N` appended. `python` means this interpreter; another
    bare program name is looked for on PATH, then next to this interpreter (so `pdserve` works
    from an unactivated venv)."""
    argv = shlex.split(command)
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    elif not shutil.which(argv[0]):
        beside = Path(sys.executable).parent / argv[0]
        if beside.exists():
            argv[0] = str(beside)
    return argv + [port_flag, str(port)]


@dataclass
class Launched:
    """A server this script started, in its own session (process group) so it can be reaped."""

    command: str
    argv: list[str]
    port: int
    proc: subprocess.Popen
    log_path: Path
    ready_s: float = math.nan

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def launch(command: str, log_dir: Path, port_flag: str = "--port", timeout: float = 600.0) -> Launched:
    """Start `command --port N` and wait until GET /health answers 200; raise if it exits first."""
    port = free_port()
    argv = _argv(command, port_flag, port)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{re.sub(r'[^A-Za-z0-9]+', '_', command).strip('_')[:60]}-{port}.log"
    log = open(log_path, "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    srv = Launched(command, argv, port, proc, log_path)
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{command!r} exited with {proc.returncode} before it was healthy; "
                               f"see {log_path}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{srv.base_url}/health", timeout=2.0).status_code == 200:
                srv.ready_s = time.monotonic() - t0
                return srv
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(srv, grace=10.0)
    raise RuntimeError(f"{command!r} not healthy after {timeout:.0f}s; see {log_path}:\n{_tail(log_path)}")


def stop(srv: Launched, grace: float = 60.0) -> dict:
    """SIGTERM the server and wait; SIGKILL its process group if it, or a child it left behind,
    outlives `grace`."""
    t0 = time.monotonic()
    if srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(grace)
        killed = False
    except subprocess.TimeoutExpired:
        killed = True
    leftover = False
    while not killed and _group_alive(srv.proc.pid) and time.monotonic() - t0 < grace + 5:
        leftover = True  # the server is gone but something it started is not (yet)
        time.sleep(0.2)
    if killed or _group_alive(srv.proc.pid):
        try:
            os.killpg(srv.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        srv.proc.wait(10)
    return {"returncode": srv.proc.returncode, "stop_s": time.monotonic() - t0,
            "killed_after_grace": killed, "children_outlived_server": leftover}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tail(path: Path, n: int = 2000) -> str:
    return path.read_bytes()[-n:].decode(errors="replace")


# ---- Prometheus text ----

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """Samples by `name{labels}` and metric types by family name."""
    samples: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            parts = line.split()
            if len(parts) >= 4:
                types[parts[2]] = parts[3]
        elif line and not line.startswith("#") and (m := _LINE.match(line)):
            try:
                samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return samples, types


def fetch_metrics(base_url: str) -> str | None:
    try:
        r = httpx.get(f"{base_url}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def snapshot(base_url: str) -> dict[str, str | None]:
    """/metrics of the server and of every worker its /health lists (pdserve's router names its
    workers there; transfer and step metrics live on the workers)."""
    snap = {"server": fetch_metrics(base_url)}
    try:
        workers = httpx.get(f"{base_url}/health", timeout=10.0).json().get("workers") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        workers = []
    for w in workers:
        if isinstance(w, dict) and w.get("url"):
            snap[f"{w.get('role', 'worker')} {w['url']}"] = fetch_metrics(str(w["url"]).rstrip("/"))
    return snap


def selected_all(before: dict[str, str | None], after: dict[str, str | None]) -> dict:
    return {name: selected(before.get(name), text) for name, text in after.items()}


def selected(before: str | None, after: str | None, words: tuple[str, ...] = ("transfer", "step")) -> dict:
    """pdserve metrics whose name has one of `words`. Histograms: the change over the run
    (after − before) as count, mean and bucket-estimated p50/p90/p99. Other series: the value
    after the run and, unless declared a gauge, its change over the run."""
    if after is None:
        return {"available": False}
    a, types = parse_metrics(after)
    b, _ = parse_metrics(before or "")
    names = {k.split("{")[0] for k in a}
    keep = {k: v for k, v in a.items()
            if k.startswith(("pdserve:", "pdserve_")) and any(w in k.split("{")[0] for w in words)
            and not k.split("{")[0].endswith("_created")}
    out: dict = {"available": True, "series": {}, "histograms": {}}
    families: dict[str, dict[str, float]] = {}
    for key, val in keep.items():
        name = key.split("{")[0]
        family = re.sub(r"_(bucket|sum|count|total)$", "", name)
        kind = types.get(family) or types.get(name) or (
            "histogram" if f"{family}_bucket" in names else "untyped")
        if kind == "histogram":
            families.setdefault(family, {})[key] = val - b.get(key, 0.0)
        elif kind == "gauge":
            out["series"][key] = {"type": kind, "value": val}
        else:
            out["series"][key] = {"type": kind, "value": val, "delta": val - b.get(key, 0.0)}
    for family, samples in families.items():
        out["histograms"][family] = _histogram(family, samples)
    return out


def _histogram(family: str, samples: dict[str, float]) -> dict:
    """Summary of one histogram family (all label sets pooled)."""
    count = sum(v for k, v in samples.items() if k.split("{")[0] == f"{family}_count")
    total = sum(v for k, v in samples.items() if k.split("{")[0] == f"{family}_sum")
    buckets: dict[float, float] = {}
    for k, v in samples.items():
        if k.split("{")[0] == f"{family}_bucket" and (m := re.search(r'le="([^"]+)"', k)):
            le = float(m.group(1))
            buckets[le] = buckets.get(le, 0.0) + v
    res = {"count": count, "sum": total, "mean": total / count if count else math.nan}
    for q in (50, 90, 99):
        res[f"p{q}"] = _bucket_quantile(sorted(buckets.items()), count, q / 100)
    return res


def _bucket_quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float:
    """Linear interpolation inside the cumulative bucket that holds the q-th observation."""
    if not count or not buckets:
        return math.nan
    rank, prev_le, prev_c = q * count, 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 1.0)
        prev_le, prev_c = le, c
    return prev_le
