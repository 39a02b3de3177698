"""Ctrl-C in the training process: SIGINT deferred over the few statements that must not be cut in two. The one
place in gigashuffle that touches SIGINT's handler (the node lock in shm/nodelock.py uses the sections below).

NOTE [ Ctrl-C ]
Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread, and a trainer that catches it
(to save a checkpoint, or in a notebook) goes on with the same loader. An interrupt between two statements of the
loader's bookkeeping used to lose state for good: a ``(reader, slot)`` popped from the dropped-batch queue or from
``ready`` and never sent or delivered, a channel message read or written by half (the stream is then out of frame),
a zygote event read and never handled, the node lock taken and never released, the teardown stopped half way
(``Exception ignored in atexit callback``). Each reader's ring has a few slots, so a few dozen interrupts stopped
delivery altogether.

Making each of those idempotent and retried would spread the problem over every data structure, and a statement
between two others can always be cut. Instead the signal is deferred over them: a ``critical()`` section (the
bookkeeping of one handover: a batch popped and delivered, a channel message read and applied, the ring slots of
dropped batches reclaimed and sent back, a zygote event read and handled, a hold of the node lock, the whole of
``shutdown()``) is microseconds of work without a wait, except the node lock's waits (below) and ``shutdown()``.

* **Whose handler.** The outermost section of the main thread puts ``_on_sigint`` in as SIGINT's handler on entry
  and puts back, on exit, whatever handler it replaced: Python's ``default_int_handler``, the script's own
  (installed before the loader or after it, chaining to the one it replaced or not: it is read afresh at every
  section, never cached across them). Over ``SIG_IGN`` or ``SIG_DFL`` nothing is installed: no Python exception
  can come of those. ``_on_sigint`` only records the signal. So inside a section no handler of the script runs,
  and outside one gigashuffle has no handler installed at all: an interrupt that lands in the script's own code
  (the optimizer's ``step()``) is the script's, and its traceback has no gigashuffle frame. Entry and exit cost one
  ``sigaction`` each (0.2 us) and only the outermost section pays them.
* **Where it is raised.** At the end of the outermost section the replaced handler is back, and a deferred
  interrupt is delivered by calling it (``default_int_handler`` raises ``KeyboardInterrupt``), with the frame of the
  nearest caller outside gigashuffle: the script's handler sees the script's frame, and what it raises comes out of
  the loader call the script made, at the end of that call's step (a batch that was being handed over is dropped,
  and its ring slot goes back like any dropped batch's).
* **Waits.** A ``critical(blocking=True)`` section (``stats()``, ``evict()``: a wait for the node lock) lets a
  Ctrl-C end its waits: the node lock raises a deferred interrupt between its attempts (``interrupt_point``), and
  while it blocks in ``flock`` (``begin_wait``/``end_wait``) the handler delivers at once, out of the system call,
  into a cleanup that unlocks unconditionally and runs deferred again. Only where every open section is such a
  section: a wait inside a plain section (a child's death handled under the lock) goes on to its end.
* **Threads.** Python runs signal handlers in the main thread only, so sections of other threads count nothing
  and install nothing: no ``KeyboardInterrupt`` can land there.

At interpreter exit (``set_exiting()``: from ``sys.excepthook`` when an uncaught exception ends the script, from
``threading._shutdown``, which Python runs before the atexit callbacks while it waits for non-daemon threads, and
from the loader's atexit hook, which then closes the loaders never closed; only while a loader is open)
``_on_sigint`` stays installed and SIGINT is ignored from then on, with a debug log line: the process is ending, and
an interrupt would only abort its teardown half way (processes, Redis keys and the embedded server left behind) or
print "Exception ignored in atexit callback" from whatever teardown comes next.
While the exit still waits for threads, a Ctrl-C that insists (a second one ``_INSIST_S`` after the first) is
delivered: a non-daemon thread that never ends must not make the exit unstoppable. SIGTERM and SIGKILL still end it.
"""

from __future__ import annotations

import _signal
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType, TracebackType
from typing import Any

log = logging.getLogger(__name__)

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


def enter(blocking: bool = False) -> bool:
    """Open a section (NOTE [ Ctrl-C ]); returns whether it counts (the main thread), to pass to ``leave``."""
    state = _state
    if _get_ident() != state.main:
        return False
    if state.depth == 0:
        _outermost_entered()
    state.depth += 1
    if blocking:
        state.blocking += 1
    return True


def leave(counted: bool, blocking: bool = False, deliver: bool = True, kind: type[BaseException] | None = None) -> None:
    """Close a section ``enter`` opened; the outermost puts the replaced handler back and delivers a deferred
    interrupt (not with ``deliver=False``: a finalizer must not raise; it waits for the next section's end)."""
    if not counted:
        return
    state = _state
    if blocking:
        state.blocking -= 1
    state.depth -= 1
    if not state.depth:
        _outermost_left(deliver, kind)


def _outermost_entered() -> None:
    state = _state
    if state.exiting:
        return  # ours stays installed until the process ends
    current = _getsignal(_SIGINT)
    if callable(current) and current is not _on_sigint:
        state.replaced = current
        # A signal already tripped runs the script's handler first (signal.signal checks them), so what it raises
        # comes out before the section began: nothing to undo.
        _setsignal(_SIGINT, _on_sigint)
    elif current is not _on_sigint:
        state.replaced = None  # ignored or default: nothing to defer, nothing to put back


def _outermost_left(deliver: bool, kind: type[BaseException] | None) -> None:
    state = _state
    if state.exiting:
        if state.pending is not None and not state.joining:
            state.pending = None
            log.debug("Ctrl-C during the teardown at exit: ignored, the teardown completed")
        return
    replaced = state.replaced
    if replaced is not None and _getsignal(_SIGINT) is _on_sigint:
        # Signals tripped meanwhile are handled (recorded) by ours before the swap: none falls between the two.
        _setsignal(_SIGINT, replaced)
    if state.pending is None or not deliver:
        return
    state.pending = None
    if kind is not None and issubclass(kind, KeyboardInterrupt):
        return  # one interrupt is on its way out already
    _deliver(replaced, _callers_frame())


def in_section() -> bool:
    """Whether the main thread is inside a section now (for checks and tests)."""
    return _state.depth > 0 and _get_ident() == _state.main


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


class critical:
    """A section the main thread's SIGINT does not cut: NOTE [ Ctrl-C ]. ``blocking``: its waits end on Ctrl-C.
    ``deliver=False``: a deferred interrupt is not raised on leaving the outermost section (a finalizer, which must
    not raise) but at the end of the next one, or, at exit, dropped."""

    __slots__ = ("_blocking", "_counted", "_deliver")

    def __init__(self, *, blocking: bool = False, deliver: bool = True) -> None:
        self._blocking = blocking
        self._deliver = deliver
        self._counted = False

    def __enter__(self) -> None:
        # enter() and leave() inlined: several sections run per batch, and only the outermost does more than count.
        state = _state
        if _get_ident() != state.main:
            return
        if not state.depth:
            _outermost_entered()
        state.depth += 1
        if self._blocking:
            state.blocking += 1
        self._counted = True

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if not self._counted:
            return
        state = _state
        if self._blocking:
            state.blocking -= 1
        state.depth -= 1
        if not state.depth:
            _outermost_left(self._deliver, kind)


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
