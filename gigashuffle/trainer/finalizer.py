"""The loader's teardown: its finalizer, and the hook that runs it for loaders never closed by interpreter exit."""

from __future__ import annotations

import atexit
import weakref
from typing import Any

from gigashuffle.procs import interrupts
from gigashuffle.procs.interrupts import critical
from gigashuffle.trainer import pinning
from gigashuffle.trainer.supervisor import Supervisor


def shutdown(placement: pinning.Placement, sup: Supervisor) -> None:
    """The loader's finalizer (it must not refer to the loader): wait for copies out of the rings, then stop
    (NOTE [ Shutdown ] in trainer/supervisor.py)."""
    with critical(deliver=False):  # whether closed, collected or run at exit: NOTE [ Ctrl-C ]
        try:
            placement.close()
        finally:
            sup.shutdown()
            interrupts.uninstall()


# NOTE [ Loaders at exit ]
# A loader never closed is closed at interpreter exit by this module's atexit hook, not by weakref.finalize's own:
# atexit runs the last registered first, and the hook is registered after the first loader's finalizer exists (so
# after weakref's), so it runs before weakref.finalize's exit pass. That pass runs the newest finalizers first,
# among them those of the objects a loader made after itself: the node lock's, which closes the lock's fd, used to
# run before the loader's shutdown, whose repair then failed with "OSError: [Errno 9] Bad file descriptor".
_OPEN_LOADERS: set[weakref.finalize[Any, Any]] = set()
_HOOKED = False


def at_exit(finalizer: weakref.finalize[Any, Any]) -> None:
    global _HOOKED
    for done in [f for f in _OPEN_LOADERS if not f.alive]:
        _OPEN_LOADERS.discard(done)
    _OPEN_LOADERS.add(finalizer)
    if not _HOOKED:
        _HOOKED = True
        atexit.register(_close_at_exit)


def _close_at_exit() -> None:
    interrupts.set_exiting()  # a Ctrl-C from now on must not cut the teardown (NOTE [ Ctrl-C ])
    with critical(deliver=False):
        while _OPEN_LOADERS:
            _OPEN_LOADERS.pop()()


interrupts.protect(_close_at_exit.__code__)
