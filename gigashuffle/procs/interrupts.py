"""Ctrl-C in the training process: SIGINT deferred over the few statements that must not be cut in two.

NOTE [ Ctrl-C ]
Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread, and a trainer that catches it
(to save a checkpoint, or in a notebook) goes on with the same loader. An interrupt between two statements of the
loader's bookkeeping used to lose state for good: a ring slot whose release callback was cut after it left the
batch registry (``Exception ignored in: <function _released>``), a ``(reader, slot)`` popped from the dropped-batch
queue or from ``ready`` and never sent or delivered, a channel message read or written by half (the stream is then
out of frame), a zygote event read and never handled, the teardown stopped half way (``Exception ignored in atexit
callback``). Each reader's ring has 8 slots, so a few dozen interrupts stopped delivery altogether.

Making each of those idempotent and retried would spread the problem over every data structure, and a statement
between two others can always be cut. Instead the signal is deferred over them, and only while the loader owns the
handler: while a loader is open in the main thread, SIGINT goes to ``_on_sigint`` (installed over Python's own
handler or the caller's, which it calls in the end). The handler raises at once unless

* a ``critical()`` section is open: the bookkeeping of one handover (a batch popped and delivered, a channel message
  read and applied, the frees sent, a zygote event read and handled, a ring slot released after its copy, the whole
  of ``shutdown()``). Each is microseconds of work without a wait, except the table calls of ``stats()``/``evict()``
  (they may wait for the node lock) and ``shutdown()``. The interrupt is recorded and raised when the outermost
  section is left, so the call that was running completes its step and the caller sees ``KeyboardInterrupt`` at
  the step's end (a batch that was being handed over is dropped, and its ring slot goes back like any dropped
  batch's). In a ``critical(blocking=True)`` section (a wait for the node lock) a second Ctrl-C at least
  ``_INSIST_S`` after the first raises at once: a user who presses it again is not kept waiting for a stopped lock
  holder. That is the one place an interrupt still lands inside, and what it cuts is the node lock's own code
  (which is exception-safe on its own).
* the frame it lands in runs a ``protect()``-ed function: the weakref callbacks that return a dropped batch's
  ring slot (``_released`` in shm/buffer.py, ``Ticket.dropped`` with pinned rings; the trainer's own part is a
  ``functools.partial`` of ``deque.append``, a C call with no frame to land in) run wherever the caller drops its
  last view, so no section can be around them. ``weakref.finalize.__call__`` is protected too, so an interrupt
  cannot fall between a finalizer leaving the registry and running (the loader's teardown would then never run),
  and so is the handler itself (signals are checked in its frame too). Such an interrupt is raised at the end of
  the next section (the loader's next call passes several) or at the next Ctrl-C, whichever comes first: it waits
  only when it landed in a callback of a few microseconds and the caller then stays away from the loader.

At interpreter exit (``set_exiting()``, called by the loader's atexit hook before it closes the loaders that were
never closed, and only if a loader was ever made) SIGINT is ignored from then on (and in ``threading._shutdown``,
which Python runs at exit before the atexit callbacks, unless it insists for ``_INSIST_S``: a non-daemon thread that
never ends must not make the exit unstoppable), with a debug log line, and the
handler stays: the process is ending, and an interrupt would only abort its teardown half way (processes, Redis keys
and the embedded server left behind) or print "Exception ignored in atexit callback" from whatever teardown comes
next. SIGTERM and SIGKILL still end it. Where the handler is not ours (another thread,
the caller installed its own after the loader, the children, which ignore SIGINT) ``critical()`` costs a counter
increment and changes nothing.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import weakref
from types import CodeType, FrameType, TracebackType
from typing import Any

log = logging.getLogger(__name__)

# In a blocking section a second Ctrl-C this long after the first interrupts at once.
_INSIST_S = 1.0


class _State:
    def __init__(self) -> None:
        self.depth = 0  # open critical() sections of the main thread
        self.blocking = 0  # of which may wait (for the node lock)
        self.pending: float | None = None  # time.monotonic() of the deferred interrupt, if one waits
        self.previous: Any = None  # the handler ours replaced, called to deliver
        self.users = 0  # open loaders that asked for the handler
        self.exiting = False
        self.protected: set[CodeType] = {weakref.finalize.__call__.__code__}


_state = _State()


# Python runs it at interpreter exit only, before the atexit callbacks (where set_exiting() comes from).
_THREADING_SHUTDOWN: CodeType | None = getattr(getattr(threading, "_shutdown", None), "__code__", None)


def _in_threading_shutdown(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code is _THREADING_SHUTDOWN:
            return True
        frame = frame.f_back
    return False


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    state = _state
    if not state.exiting and _THREADING_SHUTDOWN is not None and _in_threading_shutdown(frame):
        # The exit began, before our atexit hook: an interrupt here would skip the loaders' teardown. One that
        # insists (a non-daemon thread that never ends) still ends the wait, as without a loader.
        now = time.monotonic()
        if state.pending is None or now - state.pending < _INSIST_S:
            state.pending = state.pending if state.pending is not None else now
            log.debug("Ctrl-C at interpreter exit: ignored, the loader's teardown goes on")
            return
    if state.exiting:
        state.pending = None
        log.debug("Ctrl-C at interpreter exit: ignored, the loader's teardown goes on")
        return
    if state.depth > 0:
        insists = state.pending is not None and time.monotonic() - state.pending >= _INSIST_S
        if insists and state.blocking > 0 and (frame is None or frame.f_code not in _SECTION_CODES):
            state.pending = None
            _deliver(signum, frame)
        elif state.pending is None:
            state.pending = time.monotonic()
        return
    if frame is not None and frame.f_code in state.protected:
        if state.pending is None:
            state.pending = time.monotonic()
        return
    state.pending = None
    _deliver(signum, frame)


def _deliver(signum: int, frame: FrameType | None) -> None:
    previous = _state.previous
    if callable(previous) and previous is not _on_sigint:
        previous(signum, frame)
    else:
        raise KeyboardInterrupt


def protect(code: CodeType) -> None:
    """Defer an interrupt that lands in a frame running ``code`` (a tiny callback that runs at any moment)."""
    _state.protected.add(code)


def install() -> None:
    """Route SIGINT through ``_on_sigint`` while at least one loader is open (main thread only; elsewhere, or over
    SIG_IGN/SIG_DFL, nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        return
    # Imported here, not at the top: channel.py imports this module, and the attach client must stay stdlib-only.
    from gigashuffle.shm.nodelock import effective_sigint_handler, set_sigint_handler

    current = effective_sigint_handler()  # beneath the node lock's own deferral, if installed
    if current is _on_sigint:
        _state.users += 1
        return
    if not callable(current):
        return
    _state.previous = current
    _state.users = 1
    set_sigint_handler(_on_sigint)


def uninstall() -> None:
    """Undo one ``install()``; the last one puts the previous handler back if ours is still the one installed (not at
    exit: NOTE [ Ctrl-C ])."""
    if _state.users == 0 or _state.exiting or threading.current_thread() is not threading.main_thread():
        return
    _state.users -= 1
    from gigashuffle.shm.nodelock import effective_sigint_handler, set_sigint_handler

    if _state.users == 0 and effective_sigint_handler() is _on_sigint:
        set_sigint_handler(_state.previous)
        if _state.pending is not None:  # deferred in the last loader's teardown by a garbage collection
            _state.pending = None
            log.warning("a Ctrl-C during the teardown of a loader that was garbage-collected was not raised")


def set_exiting() -> None:
    """The interpreter is exiting: interrupts deferred from now on are dropped (NOTE [ Ctrl-C ])."""
    _state.exiting = True


_MAIN_THREAD = threading.main_thread().ident


class critical:
    """A section the main thread's SIGINT does not cut: NOTE [ Ctrl-C ]. ``deliver=False``: a deferred interrupt
    is not raised on leaving the outermost section but handed back to the main thread a moment later (a finalizer,
    which must not raise) or, at exit, dropped."""

    __slots__ = ("_blocking", "_counted", "_deliver")

    def __init__(self, *, blocking: bool = False, deliver: bool = True) -> None:
        self._blocking = blocking
        self._deliver = deliver
        self._counted = False

    def __enter__(self) -> None:
        # Only the main thread: signals are handled there, and two threads' updates of the counters could interleave.
        if threading.get_ident() != _MAIN_THREAD:
            return
        self._counted = True
        _state.depth += 1
        if self._blocking:
            _state.blocking += 1

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if not self._counted:
            return
        state = _state
        if self._blocking:
            state.blocking -= 1
        state.depth -= 1
        if state.depth or state.pending is None:
            return
        if state.exiting:
            state.pending = None
            log.debug("Ctrl-C during the teardown at exit: ignored, the teardown completed")
        elif not self._deliver:
            return  # a finalizer must not raise: the next section's end or the next Ctrl-C raises it
        elif kind is None or not issubclass(kind, KeyboardInterrupt):
            state.pending = None
            _deliver(signal.SIGINT, None)
        else:
            state.pending = None  # one interrupt is on its way out already


_SECTION_CODES = {critical.__enter__.__code__, critical.__exit__.__code__}
# An interrupt that lands in the handler itself (signals are checked in any Python frame, its own included).
protect(_on_sigint.__code__)
protect(_deliver.__code__)
