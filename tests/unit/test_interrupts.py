"""SIGINT deferred over critical sections (NOTE [ Ctrl-C ] in procs/interrupts.py), in this process's main thread:
whose handler runs where, what is raised where, waits, threads."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
from forked import held_by_a_thread

from gigashuffle.procs import interrupts
from gigashuffle.procs.interrupts import critical


@pytest.fixture(autouse=True)
def python_handler() -> Iterator[None]:
    """Each test starts with Python's own handler and must leave whatever it installed behind it."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
        assert not interrupts.in_section()
    finally:
        signal.signal(signal.SIGINT, before)


class Raising:
    """A script's own handler: raises KeyboardInterrupt, and notes the frame it was given."""

    def __init__(self, chain_to: Any = None) -> None:
        self.calls = 0
        self.frames: list[str] = []
        self.chain_to = chain_to

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.calls += 1
        self.frames.append("" if frame is None else frame.f_code.co_name)
        if callable(self.chain_to):
            self.chain_to(signum, frame)
        raise KeyboardInterrupt


def test_an_interrupt_in_a_section_is_raised_when_it_ends() -> None:
    steps = []
    with pytest.raises(KeyboardInterrupt), critical():
        signal.raise_signal(signal.SIGINT)
        steps.append("after the signal")
        with critical():
            steps.append("nested")
        steps.append("end of the outer section")
    assert steps == ["after the signal", "nested", "end of the outer section"]
    with critical():  # nothing left pending
        pass


def test_outside_a_section_no_handler_of_ours_is_installed_and_no_frame_of_ours_is_shown() -> None:
    """An interrupt in the script's own code (an optimizer's step) is the script's: no gigashuffle frame."""
    with critical():
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    script = Raising()
    signal.signal(signal.SIGINT, script)
    with critical():
        pass
    assert signal.getsignal(signal.SIGINT) is script
    with pytest.raises(KeyboardInterrupt) as caught:
        signal.raise_signal(signal.SIGINT)
    files = [frame.filename for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert not any("gigashuffle" in f for f in files), files


@pytest.mark.parametrize("arrangement", ["before", "after", "chained", "default"])
def test_the_scripts_handler_is_deferred_and_called_once_with_the_scripts_frame(arrangement: str) -> None:
    """Whatever the script installed, and whenever: inside a section nothing of it runs; at the end it runs once."""
    first = Raising()
    if arrangement == "before":
        signal.signal(signal.SIGINT, first)
    handler: Any = signal.default_int_handler
    with critical():  # a loader's section before the script's handler comes: nothing cached across sections
        pass
    if arrangement == "after":
        signal.signal(signal.SIGINT, first)
        handler = first
    elif arrangement == "chained":
        signal.signal(signal.SIGINT, first)
        second = Raising()
        second.chain_to = signal.signal(signal.SIGINT, second)  # it calls the handler it replaced
        assert second.chain_to is first
        handler = second
    elif arrangement == "before":
        handler = first

    def scripts_call() -> None:
        with critical():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # two in one section: one interrupt
            assert getattr(handler, "calls", 0) == 0 and first.calls == 0, "the script's handler ran in a section"

    with pytest.raises(KeyboardInterrupt) as caught:
        scripts_call()
    if isinstance(handler, Raising):
        assert handler.calls == 1
        assert handler.frames == ["scripts_call"], "the script's handler is shown the script's frame"
    if arrangement == "chained":
        assert first.calls == 1 and first.frames == ["scripts_call"], "the handler it chains to runs once"
    assert signal.getsignal(signal.SIGINT) is handler
    names = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert "_on_sigint" not in names and "_handle" not in names, names


def test_ignored_sigint_stays_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with critical():
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_a_finalizer_section_does_not_raise_and_the_next_section_does() -> None:
    with critical(deliver=False):
        signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), critical():
        pass


def test_sections_of_other_threads_defer_nothing() -> None:
    with held_by_a_thread(critical, 10):
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_a_wait_point_raises_only_where_every_open_section_allows_it() -> None:
    with pytest.raises(KeyboardInterrupt), critical(blocking=True):
        signal.raise_signal(signal.SIGINT)
        interrupts.interrupt_point()
        pytest.fail("not raised at the wait point of a blocking section")
    steps = []
    with pytest.raises(KeyboardInterrupt), critical():
        with critical(blocking=True):
            signal.raise_signal(signal.SIGINT)
            interrupts.interrupt_point()  # a plain section is open around it: not here
            steps.append("waited on")
        steps.append("end of the plain section")
    assert steps == ["waited on", "end of the plain section"]


def test_a_ctrl_c_ends_a_blocked_wait_and_the_cleanup_after_it_is_deferred() -> None:
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.get_ident(), signal.SIGINT))
    started = time.monotonic()
    cleaned = []
    with pytest.raises(KeyboardInterrupt), critical(blocking=True):
        timer.start()
        try:
            interrupts.begin_wait()
            try:
                time.sleep(10)  # a system call that a signal interrupts, as flock
            finally:
                interrupts.end_wait()
        finally:
            signal.raise_signal(signal.SIGINT)  # lands in the cleanup: deferred, raised at the section's end
            cleaned.append(True)
    timer.join()
    assert time.monotonic() - started < 5 and cleaned == [True]


def test_at_exit_sigint_is_ignored_and_the_teardown_runs_on() -> None:
    state = interrupts._state
    saved = (state.exiting, state.joining, state.users, state.replaced, state.pending)
    state.users += 1
    try:
        interrupts.set_exiting()
        with critical(deliver=False):
            signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # outside any section too
    finally:
        assert state.pending is None, "an interrupt ignored at exit was kept for later"
        state.exiting, state.joining, state.users, state.replaced, state.pending = saved


_UNCAUGHT = """
import os, signal, sys
from gigashuffle.procs import interrupts

def scripts_hook(kind, value, tb):  # the script's own, installed before the loader: the traceback's printer
    os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C while the exit prints the traceback
    print("hook ran to its end", flush=True)
    sys.__excepthook__(kind, value, tb)

sys.excepthook = scripts_hook
interrupts.install()  # a loader opened
if sys.argv[1] == "logged":  # a library that logs an error through sys.excepthook and goes on
    try:
        raise ValueError("logged")
    except ValueError:
        try:
            sys.excepthook(*sys.exc_info())
        except KeyboardInterrupt:
            print("interrupt raised: still running", flush=True)
    sys.exit(0)
raise RuntimeError("the script's own error")
"""


@pytest.mark.parametrize("how", ["uncaught", "logged"])
def test_an_uncaught_exception_begins_the_exit_and_a_logged_one_does_not(how: str) -> None:
    """A script ended by an exception exits from its ``sys.excepthook`` on, so a Ctrl-C from then on (here: in the
    script's own hook) is ignored instead of printing a second traceback from ``threading._shutdown``'s first
    bytecodes; ``sys.excepthook`` called by a library that goes on running leaves Ctrl-C as it was."""
    done = subprocess.run(
        [sys.executable, "-c", _UNCAUGHT, how], check=False, capture_output=True, text=True, timeout=60
    )
    if how == "uncaught":
        assert "hook ran to its end" in done.stdout, done.stderr
        assert "RuntimeError: the script's own error" in done.stderr and "KeyboardInterrupt" not in done.stderr, (
            done.stderr
        )
    else:
        assert "interrupt raised: still running" in done.stdout, (done.stdout, done.stderr)
