"""Quiet idle TP ranks: gloo's TCP loop thread wakes every 10 ms, whatever the ranks do.

Measured on an idle `pdserve serve --tp 3` (six rank processes): every rank process has one
`gloo_tcp_loop` thread that wakes 100 times a second (its `epoll_wait` has a fixed 10 ms
timeout), about 0.2 % of a core each on a busy 2-core machine — more than everything else of an
idle server together, and not something a rank can avoid by waiting elsewhere: the thread ticks
whether or not a collective is under way. `csrc/gloo_idle/gloo_idle.c` is a tiny preload that
lengthens that one thread's timeout (to $PDSERVE_GLOO_TICK_MS, default 250 ms); sockets still
wake it at once, so collectives are as fast as before (docs/liveness.md, idle CPU).

A rank gets it through ``LD_PRELOAD``, which only acts when a process starts: `preload_env()`
is set in the environment of the processes that start ranks (``pdserve serve`` for its workers;
a worker's rank 0 for its other ranks). The library is built on first use with the system C
compiler and cached by a hash of its source; when it cannot be built, nothing changes but the
idle CPU (logged once). ``PDSERVE_GLOO_IDLE=0`` turns it off.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "gloo_idle" / "gloo_idle.c"
LIB_NAME = "libpdserve_gloo_idle.so"
FLAGS = ("-O2", "-shared", "-fPIC")


def cache_root() -> Path:
    """pdserve's cache folder (the same rule as the default model's and the CPU kernels')."""
    if explicit := os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pdserve"


@functools.lru_cache(maxsize=1)
def library() -> Path | None:
    """The built preload library (built now if needed), or None when it cannot be (logged)."""
    if os.environ.get("PDSERVE_GLOO_IDLE", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    try:
        source = SOURCE.read_bytes()
    except OSError as e:
        logger.info("idle TP ranks keep gloo's 10 ms tick: no %s (%s)", SOURCE.name, e)
        return None
    if cc is None:
        logger.info("idle TP ranks keep gloo's 10 ms tick: no C compiler to build %s", LIB_NAME)
        return None
    key = hashlib.sha256(source + " ".join((cc, *FLAGS)).encode()).hexdigest()[:16]
    lib = cache_root() / "gloo-idle" / key / LIB_NAME
    if lib.exists():
        return lib
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        proc = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-ldl"], capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            logger.warning("idle TP ranks keep gloo's 10 ms tick: building %s failed: %s", LIB_NAME,
                           proc.stderr.strip()[-500:])
            return None
        os.replace(tmp, lib)  # atomic: concurrent builders each write their own file
    except OSError as e:  # a read-only cache, a compiler that cannot run
        logger.warning("idle TP ranks keep gloo's 10 ms tick: cannot build %s: %s", LIB_NAME, e)
        return None
    return lib


def preload_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``{"LD_PRELOAD": ...}`` with the library added (to `environ`'s, default os.environ's),
    or {} when there is none or it is there already."""
    lib = library()
    current = (os.environ if environ is None else environ).get("LD_PRELOAD", "")
    if lib is None or str(lib) in current.split():
        return {}
    return {"LD_PRELOAD": f"{lib} {current}".strip()}
