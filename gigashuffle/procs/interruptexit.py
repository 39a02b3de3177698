"""The interpreter's exit: from its start SIGINT is ignored, so that a Ctrl-C cannot cut the loaders' teardown
(NOTE [ Ctrl-C ] in procs/interrupts.py)."""

from __future__ import annotations

import sys
import threading
from types import TracebackType
from typing import Any

from gigashuffle.procs.sigint import _SIGINT, _get_ident, _getsignal, _on_sigint, _setsignal, _state, log


def install() -> None:
    """A loader opened: from now on the start of the interpreter's exit is noticed (``set_exiting``)."""
    state = _state
    state.users += 1
    register = getattr(threading, "_register_atexit", None)  # runs at the start of threading._shutdown
    if not state.hooked and register is not None:
        try:
            register(_exit_begins)
            state.hooked = True
        except RuntimeError:  # the exit began already
            return
        global _script_excepthook
        _script_excepthook = sys.excepthook
        sys.excepthook = _excepthook


_script_excepthook: Any = sys.__excepthook__


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """An exception ended the script: its exit begins here, not at ``threading._shutdown`` (a Ctrl-C on the first
    bytecodes of that function, before its hooks ran, printed "Exception ignored in: <module 'threading'>").
    Only when the interpreter itself calls it (no Python caller: a library that calls ``sys.excepthook`` to log
    an error goes on running) and not in an interactive session, which goes on after every error."""
    if sys._getframe().f_back is None and not sys.flags.interactive and not hasattr(sys, "ps1"):
        _exit_begins()
    _script_excepthook(kind, value, tb)


def uninstall() -> None:
    """A loader closed (not at exit: NOTE [ Ctrl-C ])."""
    state = _state
    if state.users == 0 or state.exiting:
        return
    state.users -= 1
    if state.users == 0 and state.pending is not None and state.depth == 0:
        state.pending = None  # deferred in the last loader's teardown by a garbage collection
        log.warning("a Ctrl-C during the teardown of a loader that was garbage-collected was not raised")


def _exit_begins() -> None:
    if _state.users:
        set_exiting(joining=True)


def set_exiting(joining: bool = False) -> None:
    """The interpreter is exiting: SIGINT is ignored from now on (NOTE [ Ctrl-C ]). ``joining``: called while the
    exit still waits for non-daemon threads (an insisting Ctrl-C is delivered there)."""
    state = _state
    state.joining = joining
    if state.exiting:
        return
    state.exiting = True
    state.pending = None
    if _get_ident() != state.main or not state.users:  # no loader left to tear down: Ctrl-C is the script's
        return
    current = _getsignal(_SIGINT)
    if callable(current) and current is not _on_sigint:
        state.replaced = current
        _setsignal(_SIGINT, _on_sigint)
