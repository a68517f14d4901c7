"""QuietServer (pdserve/quiet_server.py): uvicorn's main loop ticks once a second, not ten
times, and setting should_exit from another thread stops the server at once."""
from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from pdserve.quiet_server import QuietServer
from tests.frontend.conftest import free_port


async def _app(scope, receive, send) -> None:  # a bare ASGI app: nothing is served
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            pass
        return


class CountingServer(QuietServer):
    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return await super().on_tick(counter)


def test_ticks_once_a_second_and_exits_at_once_when_told():
    server = CountingServer(uvicorn.Config(_app, host="127.0.0.1", port=free_port(), log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    time.sleep(2.0)
    assert server.ticks <= 4, server.ticks  # uvicorn's own loop: about 20 in 2 s
    told = time.monotonic()
    server.should_exit = True  # from another thread, as a drain thread does
    thread.join(timeout=5)
    assert not thread.is_alive() and time.monotonic() - told < 0.5
