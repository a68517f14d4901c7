"""The overlapped loop's forward thread (scheduler/forward_thread.py): jobs run on one other
thread, one at a time; results and errors come back to the caller's thread; close waits."""
from __future__ import annotations

import threading

import pytest

from pdserve.scheduler.forward_thread import ForwardThread


def test_jobs_run_on_one_other_thread_and_return_in_order():
    ft = ForwardThread()
    names = []
    for i in range(50):
        ft.start(lambda i=i: (names.append(threading.current_thread().name), i)[1])
        assert ft.busy
        assert ft.wait() == i
        assert not ft.busy
    ft.close()
    assert set(names) == {"forward"}


def test_an_error_is_raised_by_wait_and_the_thread_goes_on():
    ft = ForwardThread()
    ft.start(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ft.wait()
    ft.start(lambda: "next")
    assert ft.wait() == "next"
    with pytest.raises(RuntimeError, match="no job"):
        ft.wait()
    ft.close()


def test_close_waits_for_the_running_job():
    ft = ForwardThread()
    gate, done = threading.Event(), []
    ft.start(lambda: (gate.wait(5), done.append(True)))
    closer = threading.Thread(target=ft.close)
    closer.start()
    assert not done
    gate.set()
    closer.join(5)
    assert done == [True] and not closer.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        ft.start(lambda: None)
