"""Forked children (and threads) for tests that need a second process (or thread) holding or waiting on something,
each with a deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

WAIT_S = 30.0


def fork_child(body: Callable[[], int]) -> int:
    """Run ``body`` in a forked child (its return value is the exit code); returns the pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = body()
        finally:
            os._exit(code)
    return pid


def wait_child(pid: int, wait_s: float = WAIT_S) -> int:
    """The child's wait status, within a deadline (a child stuck on a lock fails the test instead of hanging)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"child {pid} did not finish within {wait_s}s")


@contextlib.contextmanager
def held_by_a_thread(
    context: Callable[[], contextlib.AbstractContextManager[object]], wait_s: float = WAIT_S
) -> Iterator[None]:
    """Another thread enters ``context()`` and stays inside it while the body runs; it leaves, and is joined, after."""
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with context():
            inside.set()
            leave.wait(wait_s)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        if not inside.wait(wait_s):
            raise AssertionError(f"the thread did not enter its context within {wait_s}s")
        yield
    finally:
        leave.set()
        thread.join(wait_s)
