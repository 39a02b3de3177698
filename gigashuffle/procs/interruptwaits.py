"""Waits a Ctrl-C may end: the node lock's, inside ``critical(blocking=True)`` sections (NOTE [ Ctrl-C ] in
procs/interrupts.py, "Waits")."""

from __future__ import annotations

from gigashuffle.procs.sigint import _callers_frame, _deliver, _get_ident, _state


def _waits_may_end() -> bool:
    state = _state
    return state.depth == state.blocking and not state.exiting and _get_ident() == state.main


def interrupt_point() -> None:
    """Between two attempts of a wait: deliver a deferred interrupt now if every open section lets a Ctrl-C end its
    waits (nothing is held here)."""
    state = _state
    if state.pending is not None and state.depth and _waits_may_end():
        state.pending = None
        _deliver(state.replaced, _callers_frame())


def begin_wait() -> None:
    """About to block in a system call that a signal interrupts (``flock``): a deferred interrupt is delivered now,
    and one that comes while blocked is delivered at once, out of the call (when every open section allows it). The
    caller's cleanup must run after ``end_wait()`` and be safe whether or not the call completed."""
    if not _waits_may_end():
        return
    interrupt_point()
    _state.waiting = True


def end_wait() -> None:
    _state.waiting = False
