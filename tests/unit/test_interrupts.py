"""SIGINT deferred over critical sections (NOTE [ Ctrl-C ] in procs/interrupts.py), in this process's main thread."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest

from gigashuffle.procs import interrupts
from gigashuffle.procs.interrupts import critical


@pytest.fixture
def handler() -> Iterator[None]:
    before = signal.getsignal(signal.SIGINT)
    interrupts.install()
    try:
        yield
    finally:
        interrupts.uninstall()
        assert signal.getsignal(signal.SIGINT) is before, "the last uninstall puts the previous handler back"


@pytest.mark.usefixtures("handler")
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


@pytest.mark.usefixtures("handler")
def test_an_interrupt_outside_a_section_is_raised_at_once() -> None:
    steps = []
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
        steps.append("not reached")
    assert steps == []


@pytest.mark.usefixtures("handler")
def test_an_interrupt_in_a_protected_function_waits_for_the_next_section() -> None:
    calls = []

    def callback() -> None:
        signal.raise_signal(signal.SIGINT)
        calls.append("callback ran to its end")

    interrupts.protect(callback.__code__)
    callback()
    assert calls == ["callback ran to its end"]
    with pytest.raises(KeyboardInterrupt), critical():
        calls.append("section")
    assert calls == ["callback ran to its end", "section"]


@pytest.mark.usefixtures("handler")
def test_a_finalizer_section_does_not_raise_and_the_next_section_does() -> None:
    with critical(deliver=False):
        signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), critical():
        pass


@pytest.mark.usefixtures("handler")
def test_sections_of_other_threads_defer_nothing() -> None:
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with critical():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert inside.wait(10)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        leave.set()
        thread.join(10)
