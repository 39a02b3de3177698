"""Ctrl-C in the training process: SIGINT deferred over the few statements that must not be cut in two. With
procs/sigint.py (the handler and its state), procs/interruptwaits.py (waits a Ctrl-C may end) and
procs/interruptexit.py (the interpreter's exit), the one place in gigashuffle that touches SIGINT's handler (the
node lock in shm/nodelock.py uses the sections below).

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

import logging
from types import TracebackType

from gigashuffle.procs.interruptexit import install, set_exiting, uninstall
from gigashuffle.procs.interruptwaits import begin_wait, end_wait, interrupt_point
from gigashuffle.procs.sigint import (
    _SIGINT,
    _callers_frame,
    _deliver,
    _get_ident,
    _getsignal,
    _on_sigint,
    _setsignal,
    _state,
)

log = logging.getLogger(__name__)


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


__all__ = [
    "begin_wait",
    "critical",
    "end_wait",
    "enter",
    "in_section",
    "install",
    "interrupt_point",
    "leave",
    "set_exiting",
    "uninstall",
]
