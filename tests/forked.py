"""Forked children for tests that need a second process holding or waiting on something, each with a deadline."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

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
