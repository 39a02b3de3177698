"""Ctrl-C in a training script (NOTE [ Ctrl-C ] in procs/interrupts.py, [ Loaders at exit ] in trainer/teardown.py).

Real interpreters run tests/chaos/ctrl_c_script.py: a SIGINT storm against a trainer that catches
``KeyboardInterrupt`` and goes on, a script that exits without ``close()``, and one interrupted without ``with``
and then interrupted again and again while it tears down at exit. Each checks what the user would see on stderr
and what the loader leaves behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from timing import startup_deadline

import gigashuffle

SCRIPT = Path(__file__).with_name("ctrl_c_script.py")
REPO_ROOT = Path(gigashuffle.__file__).resolve().parent.parent
DEADLINE_S = startup_deadline(120.0, startups=40)
NOISE = ("Exception ignored", "Bad file descriptor", "Traceback (most recent call last)")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("GIGASHUFFLE_REDIS_URL", None)  # the no-close scripts use the embedded server
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _queue() -> str:
    return f"ctrlc-{uuid.uuid4().hex[:8]}"


def _closed_line(stderr: str) -> bool:
    return "loader of ctrlc-" in stderr and " closed (pid " in stderr


def _wait_gone(pids: list[int], deadline_s: float) -> list[int]:
    """The pids still running (zombies count as gone: their parent is the exited script) after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    alive = pids
    while alive and time.monotonic() < end:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    return alive


def _storm(*args: str, least: int) -> tuple[dict[str, Any], str]:
    """Run ``ctrl_c_script.py`` with ``args``; its result and what to show on a failure, after the checks every
    storm shares: at least ``least`` interrupts caught, rings whole, nothing held, the lock free, 200 batches after
    the storm and no noise on stderr."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=_env(), capture_output=True, text=True, timeout=DEADLINE_S, check=False,
    )  # fmt: skip
    detail = f"exit code {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, detail
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["caught"] >= least, f"too few interrupts landed to mean anything:\n{detail}"
    assert result["rings_whole"], f"ring slots lost to an interrupt (ready by reader vs depth):\n{detail}"
    assert result["held"] == [0, 0], f"the trainer counts batches as held that nobody holds:\n{detail}"
    assert result["lock_free"], f"the node lock stayed held after the storm:\n{detail}"
    assert result["after"] == 200, f"the loader stopped delivering after the storm:\n{detail}"
    for noise in NOISE:
        assert noise not in proc.stderr, detail
    return result, detail


@pytest.mark.usefixtures("runtime_dir")
def test_sigint_storm_leaves_a_loader_that_delivers(redis_url: str) -> None:
    _storm("storm", redis_url, _queue(), "6", "30", least=200)


# Seconds of the handler storm: 3 in the suite; issue 33's probe stormed 8 s (CTRL_C_STORM_S=8 runs that).
STORM_S = float(os.environ.get("CTRL_C_STORM_S", "3"))


@pytest.mark.usefixtures("runtime_dir")
@pytest.mark.parametrize("arrangement", ["after", "before", "chained"])
def test_a_scripts_own_handler_under_a_ctrl_c_storm_loses_no_ring_slot(redis_url: str, arrangement: str) -> None:
    """The script's own SIGINT handler raises wherever a Ctrl-C lands (installed after the loader, before it, or
    chaining to the one it replaced), a Ctrl-C about every 50 ms for ``STORM_S``: both rings come back whole, the
    loader delivers 200 of 200 batches after it, and stderr has no "Exception ignored" (``_storm``'s checks)."""
    least = max(20, int(STORM_S * 7))  # about 20 a second are sent
    result, detail = _storm("handler_storm", redis_url, _queue(), arrangement, str(STORM_S), "30", least=least)
    assert result["handler_kept"], f"the script's handler was replaced:\n{detail}"
    assert result["handler_calls"] >= result["caught"], detail
    print(f"\n[storm {arrangement} {STORM_S:g}s] {json.dumps(result)}")


@pytest.mark.usefixtures("runtime_dir")
def test_exit_without_close_tears_down_silently() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "no_close", _queue()],
        env=_env(), capture_output=True, text=True, timeout=DEADLINE_S, check=False,
    )  # fmt: skip
    detail = f"exit code {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0 and "DONE" in proc.stdout, detail
    for noise in NOISE:
        assert noise not in proc.stderr, detail
    assert _closed_line(proc.stderr), f"the teardown at exit did not run to its end:\n{detail}"


class _StderrLines:
    """A script's stderr, read line by line by a thread; ``seen`` is set at the first line ``matches`` accepts."""

    def __init__(self, proc: subprocess.Popen[str], matches: Callable[[str], bool]) -> None:
        self.lines: list[str] = []
        self.seen = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(proc, matches), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str], matches: Callable[[str], bool]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.lines.append(line)
            if matches(line):
                self.seen.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    @property
    def text(self) -> str:
        return "".join(self.lines)


def _ready_pids(proc: subprocess.Popen[str], stderr_lines: _StderrLines) -> list[int]:
    """The pids of the script's loader, from its ``READY`` line; a script that died before it fails the test with
    its stderr."""
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the script prints it within DEADLINE_S or dies (then this returns "")
    if not line.startswith("READY "):
        _kill_if_running(proc)
        proc.wait(DEADLINE_S)
        stderr_lines.join(DEADLINE_S)
        raise AssertionError(f"no READY line ({line!r}), exit code {proc.returncode}:\n{stderr_lines.text[-6000:]}")
    pids: list[int] = json.loads(line.split(" ", 1)[1])
    return pids


def _kill_if_running(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.usefixtures("runtime_dir")
def test_ctrl_c_without_with_tears_down_under_more_ctrl_c() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "interrupted", _queue()],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # The last line of the script's traceback.
    stderr_lines = _StderrLines(proc, lambda line: line.strip() == "KeyboardInterrupt")
    sent = 0
    try:
        assert proc.stdout is not None
        pids = _ready_pids(proc, stderr_lines)
        proc.send_signal(signal.SIGINT)  # interrupts the loop: the traceback, then the teardown at exit
        sent += 1
        # The next ones land in the teardown (a second Ctrl-C while Python prints the first one's traceback would
        # cut that printing: Python's own, not the loader's).
        assert stderr_lines.seen.wait(DEADLINE_S), stderr_lines.text
        rnd = random.Random(1)
        end = time.monotonic() + DEADLINE_S
        while proc.poll() is None and time.monotonic() < end:
            proc.send_signal(signal.SIGINT)
            sent += 1
            time.sleep(rnd.uniform(0.001, 0.01))
        proc.wait(DEADLINE_S)
        stderr_lines.join(DEADLINE_S)
    finally:
        _kill_if_running(proc)
    stderr = stderr_lines.text
    detail = f"exit code {proc.returncode}, {sent} SIGINTs\n--- stderr\n{stderr[-6000:]}"
    assert "Ctrl-C at interpreter exit: ignored" in stderr, f"no SIGINT landed in the teardown:\n{detail}"
    # The script's own KeyboardInterrupt traceback is what the user asked for; nothing else may be printed.
    assert stderr.count("KeyboardInterrupt") == 1 and "Exception ignored" not in stderr, detail
    assert "Bad file descriptor" not in stderr, detail
    assert _closed_line(stderr), f"the teardown at exit did not run to its end:\n{detail}"
    assert _wait_gone(pids, 10.0) == [], f"processes outlived the script: {pids}\n{detail}"


@pytest.mark.usefixtures("runtime_dir")
def test_ctrl_c_while_the_exit_waits_for_a_thread_does_not_cut_the_teardown() -> None:
    """Python's exit joins non-daemon threads in ``threading._shutdown`` before it runs the atexit callbacks (where
    the loader's teardown starts): a Ctrl-C there is ignored, and the teardown runs once the thread ends."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "exit_joins_a_thread", _queue()],
        env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    stderr_lines = _StderrLines(proc, lambda line: "Ctrl-C at interpreter exit: ignored" in line)
    try:
        pids = _ready_pids(proc, stderr_lines)
        assert proc.stdout.readline() == "EXITING\n", stderr_lines.text  # the exit waits in threading._shutdown
        proc.send_signal(signal.SIGINT)
        assert stderr_lines.seen.wait(DEADLINE_S), stderr_lines.text  # handled there, while the exit still waits
        proc.stdin.close()  # the thread ends: the exit goes on to the teardown
        proc.wait(DEADLINE_S)
        stderr_lines.join(DEADLINE_S)
    finally:
        _kill_if_running(proc)
    stderr = stderr_lines.text
    detail = f"exit code {proc.returncode}\n--- stderr\n{stderr[-6000:]}"
    assert proc.returncode == 0, detail
    assert "KeyboardInterrupt" not in stderr and "Exception ignored" not in stderr, detail
    assert _closed_line(stderr), f"the teardown at exit did not run to its end:\n{detail}"
    assert _wait_gone(pids, 10.0) == [], f"processes outlived the script: {pids}\n{detail}"
