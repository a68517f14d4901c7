"""One API request's choices, started together, their events merged into one queue.

Workers are picked for every choice before anything is sent, so "no worker available" is a
plain 503 even for a streaming request. Cancelling the generation (the client went away, or
one choice failed) aborts every choice's room on its workers.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from pdserve.frontend.choice import ChoiceEvent, ChoiceRun, ChoiceSpec, Services
from pdserve.frontend.errors import APIError
from pdserve.frontend.output import OutputDecoder
from pdserve.frontend.workers import WorkerPool


class Generation:
    def __init__(self, specs: list[ChoiceSpec], make_decoder: Callable[[ChoiceSpec], OutputDecoder],
                 pool: WorkerPool, services: Services, stream_batch: int = 1) -> None:
        self.queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        self.runs: list[ChoiceRun] = []
        try:
            for spec in specs:
                self.runs.append(ChoiceRun(spec, pool.pick(), make_decoder(spec), self.queue.put_nowait,
                                           services, stream_batch))
        except APIError:
            self.cancel()
            raise

    def start(self) -> None:
        for run in self.runs:
            run.start()

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's events in arrival order, until each choice has ended."""
        left = len(self.runs)
        while left:
            ev = await self.queue.get()
            left -= ev.last
            yield ev

    def cancel(self, origin: str = "client") -> None:
        """Stop what still runs (idempotent; a no-op for choices that ended). `origin`: who
        stopped it, for the abort metrics ("client": the client left)."""
        for run in self.runs:
            run.cancel(origin)

    def fail(self, error: APIError, origin: str) -> None:
        """End every choice still running with `error` (its client gets it)."""
        for run in self.runs:
            run.fail(error, origin)
