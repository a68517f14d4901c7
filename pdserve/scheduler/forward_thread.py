"""The forward thread of the overlapped loop (lockstep.py): one job at a time, handed over with
two plain locks.

Why not a `ThreadPoolExecutor`: each `submit` builds a future, a work item and a queue entry,
and `result()` waits on a condition variable that allocates a lock per wait; two locks used as
binary semaphores do the same round trip in about half the time (docs/overlap.md).

`start` does not wait for the job to begin. Waiting (so that the GIL passes to the forward
thread at once, before the loop thread's Python work) was measured and lost: the forward holds
the GIL through stretches of its Python, and the loop thread then waited up to the switch
interval for it (docs/overlap.md, "The hand-off").
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ForwardThread(Generic[T]):
    """Runs `start(job)`'s job on its own thread; `wait()` returns its result or raises its
    error, on the caller's thread. Used by one caller thread; at most one job in flight."""

    def __init__(self, name: str = "forward"):
        self._go = _closed_lock()    # released by start(): a job is there
        self._done = _closed_lock()  # released by the thread when the job has ended
        self._job: Callable[[], T] | None = None
        self._result: T | None = None
        self._error: BaseException | None = None
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A job was started and not yet waited for."""
        return self._busy

    def start(self, job: Callable[[], T]) -> None:
        """Run `job` on the thread (returns at once)."""
        if self._busy or self._closed:
            raise RuntimeError("the forward thread is busy or closed")
        self._job, self._busy = job, True
        self._go.release()

    def wait(self) -> T:
        """The running job's result (its exception is raised here)."""
        if not self._busy:
            raise RuntimeError("no job was started")
        self._done.acquire()
        self._busy = False
        result, error = self._result, self._error
        self._result = self._error = None
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    def close(self) -> None:
        """Wait for a running job (its error is dropped: the loop is ending) and end the thread."""
        if self._closed:
            return
        if self._busy:
            try:
                self.wait()
            except BaseException:  # noqa: BLE001 — logged; the caller is shutting down
                logger.exception("the last forward failed while the loop was closing")
        self._closed = True
        self._job = None
        self._go.release()
        self._thread.join()

    def _main(self) -> None:
        while True:
            self._go.acquire()
            job = self._job
            if job is None:  # close()
                return
            self._job = None
            try:
                self._result = job()
            except BaseException as e:  # noqa: BLE001 — handed to the loop thread by wait()
                self._error = e
            self._done.release()


def _closed_lock() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock
