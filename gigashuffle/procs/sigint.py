"""SIGINT's handler while a section defers it, the state it shares with the sections, and a deferred interrupt's
delivery (NOTE [ Ctrl-C ] in procs/interrupts.py)."""

from __future__ import annotations

import _signal
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

# Named for procs/interrupts.py, whose mechanism this is: scripts and the chaos tests set that logger's level.
log = logging.getLogger("gigashuffle.procs.interrupts")

# While the exit waits for threads, a second Ctrl-C this long after the first is delivered.
_INSIST_S = 1.0
# _signal's, not signal's: the latter wrap handlers in enums (0.5 us a call), and these run per section.
_getsignal, _setsignal, _SIGINT = _signal.getsignal, _signal.signal, int(signal.SIGINT)
_get_ident = threading.get_ident


class _State:
    def __init__(self) -> None:
        self.main = threading.main_thread().ident  # kept current across fork (below)
        self.depth = 0  # open sections of the main thread
        self.blocking = 0  # of which let a Ctrl-C end their waits
        self.replaced: Any = None  # the handler the outermost section (or the exit) replaced with ours
        self.pending: float | None = None  # time.monotonic() of the deferred interrupt, if one waits
        self.waiting = False  # blocked in a system call at a wait point: the next Ctrl-C is delivered at once
        self.users = 0  # open loaders
        self.exiting = False
        self.joining = False  # the exit waits for non-daemon threads (threading._shutdown), before the atexit hooks
        self.hooked = False  # set_exiting registered with threading


_state = _State()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    """SIGINT's handler inside sections and at exit: records, and delivers only where NOTE [ Ctrl-C ] says."""
    state = _state
    if state.exiting:
        now = time.monotonic()
        if state.joining and state.pending is not None and now - state.pending >= _INSIST_S:
            state.pending = None
            _deliver(state.replaced, frame)
            return
        if state.joining and state.pending is None:
            state.pending = now  # the first of the exit: the one that may insist
        log.debug("Ctrl-C at interpreter exit: ignored, the loader's teardown goes on")
        return
    if state.waiting:
        state.waiting = False  # one interrupt ends the wait; the cleanup after it runs deferred again
        state.pending = None
        _deliver(state.replaced, _callers_frame())
        return
    # Recorded at depth 0 too: between an outermost section's swaps and its count (a signal that ``signal.signal``
    # handles before it puts the script's handler back, or one right after ours went in), where raising would leave
    # ours installed outside any section. The section's end (that one, or the next) delivers it.
    if state.pending is None:
        state.pending = time.monotonic()


def _deliver(handler: Any, frame: FrameType | None) -> None:
    """Run the handler the section replaced, as the signal would have (``KeyboardInterrupt`` if there is none)."""
    if callable(handler) and handler is not _on_sigint:
        handler(_SIGINT, frame)
    else:
        raise KeyboardInterrupt


def _callers_frame() -> FrameType | None:
    """The innermost frame outside gigashuffle: where the script called the loader (what its handler is shown)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("gigashuffle."):
        frame = frame.f_back
    return frame


def _after_fork_in_child() -> None:
    # The child's one thread is its main thread, and no section of the parent's is open in it.
    state = _state
    state.main = _get_ident()
    state.depth = state.blocking = 0
    state.pending = None
    state.waiting = False
    state.users = 0
    if state.replaced is not None and not state.exiting and _getsignal(_SIGINT) is _on_sigint:
        _setsignal(_SIGINT, state.replaced)  # forked inside a section: the child starts with the script's handler


os.register_at_fork(after_in_child=_after_fork_in_child)
