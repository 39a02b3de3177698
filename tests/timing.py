"""Deadlines for waits on process start-up, derived from how long starting one takes on this machine right now.

A loader's first batch waits for a zygote (a fresh interpreter that imports torch) and its children; a torchrun
job starts agents and ranks that each import torch. On an idle 2-core machine that import takes about 1.5 s; under
load it can take several times as long. A fixed deadline is then either too tight under load (a flaky test) or
needlessly long everywhere. :func:`startup_deadline` keeps a generous floor and grows it with the measured cost.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

_ENV = "GIGASHUFFLE_TEST_STARTUP_S"


def startup_s() -> float:
    """Wall seconds for a fresh interpreter to import torch and gigashuffle.

    Measured once per test process and passed on in the environment, so that processes a test starts (loader
    children import the test datasets module) reuse the figure instead of measuring again.
    """
    if _ENV not in os.environ:
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch, gigashuffle"], check=True, timeout=300)
        os.environ[_ENV] = f"{time.monotonic() - started:.3f}"
    return float(os.environ[_ENV])


def startup_deadline(floor_s: float, startups: float) -> float:
    """``floor_s``, or ``startups`` interpreter start-ups if this machine is slower than that right now."""
    return max(floor_s, startups * startup_s())


class DeadlineExceeded(BaseException):
    """A call in the main thread ran past its deadline (a BaseException, so no ``except Exception`` eats it)."""


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Raise ``DeadlineExceeded`` in the main thread if the block runs longer than ``seconds``."""
    old_handler = signal.getsignal(signal.SIGALRM)
    old_delay, old_interval = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()

    def on_alarm(_signum: int, _frame: Any) -> None:
        raise DeadlineExceeded(f"{what} did not finish within {seconds:.0f} s")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:  # pytest-timeout's timer: give back what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - start), 0.001), old_interval)
