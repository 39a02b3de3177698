"""Run a test's body in a lean interpreter: a fresh process that imported only the body's own module.

Why: tests that fork hundreds of children (the slot table's kill tests and its state machine) pay for every fork
in proportion to the forking process's anonymous memory, which the kernel copies page tables for, write-protects,
and tears down again when the child dies. A pytest worker has imported every collected test module (transformers,
lightning, datasets: about 400 MB anonymous), a fresh interpreter that imports the slot table and its test module
(torch: about 170 MB) about half that, so each fork, each child's copy-on-write faults and each child's exit cost
about half as much. The body runs unchanged there: it creates its tables and forks its children itself, exactly
as it would in the worker.

``LeanProcess.call(module, function, *args)`` runs ``module.function(*args)`` in the lean process (arguments and
result pickled) and re-raises its failure with the body's traceback (hypothesis' falsifying example included).
Its stdout and stderr are the worker's, so pytest captures them with the test's.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import pytest

from gigashuffle.host.parentdeath import set_parent_death_signal

STOP_S = 30.0


class LeanProcess:
    """A fresh interpreter serving calls over a socket until closed; it dies with the test process."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        self._conn = Connection(ours.detach())

    def call(self, module: str, function: str, *args: Any, timeout_s: float = 280.0) -> Any:
        """``module.function(*args)`` in the lean process, within ``timeout_s`` (under pytest-timeout's 300 s)."""
        self._conn.send((module, function, args))
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(max(deadline - time.monotonic(), 0)):
            if time.monotonic() >= deadline:
                self.close()
                raise AssertionError(f"{module}.{function}{args} did not return within {timeout_s}s")
        try:
            ok, value = self._conn.recv()
        except EOFError:
            code = self._proc.wait(timeout=STOP_S)
            raise AssertionError(f"the lean process died (exit status {code}) in {module}.{function}{args}") from None
        if not ok:
            pytest.fail(f"{module}.{function}{args} failed in the lean process:\n{value}", pytrace=False)
        return value

    def close(self) -> None:
        self._conn.close()  # the lean process ends at EOF
        try:
            self._proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=STOP_S)


def _serve(fd: int, parent: int) -> None:
    set_parent_death_signal(parent)  # the loader's children's, exits if the test process is already gone
    conn = Connection(fd)
    while True:
        try:
            module, function, args = conn.recv()
        except EOFError:
            return
        try:
            reply: tuple[bool, Any] = (True, getattr(importlib.import_module(module), function)(*args))
        except BaseException:
            reply = (False, traceback.format_exc())
        conn.send(reply)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
