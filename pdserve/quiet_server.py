"""A uvicorn server whose main loop does not wake ten times a second.

uvicorn's ``Server.main_loop`` sleeps 0.1 s between ticks: each tick refreshes the ``Date``
header (once a second) and looks at ``should_exit``. An idle router or worker thus wakes 10
times a second for nothing (measured: the largest share of an idle router's CPU). Here a tick
comes once a second (the ``Date`` header's resolution), and setting ``should_exit`` (from a
signal handler, a drain thread or the loop itself) wakes the loop at once, so shutdown is no
slower. The router and the workers both serve through it (docs/liveness.md, idle CPU).
"""
from __future__ import annotations

import asyncio

import uvicorn

TICK_S = 1.0


class QuietServer(uvicorn.Server):
    """``uvicorn.Server`` with a one-second tick and an immediate wake on ``should_exit``."""

    _tick_loop: asyncio.AbstractEventLoop | None = None
    _tick_wake: asyncio.Event | None = None
    _exit = False

    @property
    def should_exit(self) -> bool:  # type: ignore[override]
        return self._exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit = value
        loop, wake = self._tick_loop, self._tick_wake
        if value and loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed meanwhile: nothing waits on it any more
                pass

    async def main_loop(self) -> None:
        self._tick_loop, self._tick_wake = asyncio.get_running_loop(), asyncio.Event()
        # on_tick refreshes the Date header when counter % 10 == 0: every tick here is a second
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000
            try:
                await asyncio.wait_for(self._tick_wake.wait(), TICK_S)
            except asyncio.TimeoutError:
                pass
            should_exit = await self.on_tick(counter)
