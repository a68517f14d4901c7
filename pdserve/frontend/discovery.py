"""Workers found through DNS: ``NAME:PORT`` of a headless Service, one A record per ready pod.

Every ``interval_s`` each target is resolved again and the pool's workers from it follow the
answer (``WorkerPool.sync``): scaling a worker Deployment needs no router change. A name that
does not exist (a headless Service with no ready pod answers NXDOMAIN) means no workers; any
other resolver failure keeps the workers as they were, so a DNS hiccup drains nothing.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from pdserve.frontend.workers import WorkerPool
from pdserve.worker_api import Role

logger = logging.getLogger(__name__)
Resolver = Callable[[str, int], Awaitable[list[str]]]
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class Target(NamedTuple):
    role: Role
    host: str
    port: int

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"


def parse_target(role: Role, text: str) -> Target:
    """``NAME:PORT`` → Target; ValueError for anything else."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected NAME:PORT (e.g. pdserve-decode-headless:8200), got {text!r}")
    return Target(role, host, int(port))


async def resolve_ipv4(host: str, port: int) -> list[str]:
    """The A records of `host` (sorted); [] when the name does not exist."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in _NO_SUCH_NAME:
            return []
        raise
    return sorted({str(info[4][0]) for info in infos})


class Discovery:
    def __init__(self, pool: WorkerPool, targets: list[Target], interval_s: float = 5.0,
                 resolve: Resolver = resolve_ipv4) -> None:
        self.pool = pool
        self.targets = targets
        self.interval_s = interval_s
        self.resolve = resolve

    async def refresh(self) -> None:
        """Resolve every target once and update the pool."""
        for t in self.targets:
            try:
                addresses = await self.resolve(t.host, t.port)
            except OSError as e:
                logger.warning("cannot resolve %s (%s workers): %s; keeping the workers as they are",
                               t.name, t.role.value, e)
                continue
            self.pool.sync(t.name, t.role, [f"http://{a}:{t.port}" for a in addresses])

    async def run(self) -> None:
        """Refresh every `interval_s`, forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()
