"""The loader's teardown: its finalizer, and the hook that runs it for loaders never closed by interpreter exit.

NOTE [ Shutdown ]
The teardown order, per actor, written once; each step assumes the ones before it are done.
* Trainer (``loader.close()``, ``__exit__``, or the loader's ``weakref.finalize`` at garbage collection or
  interpreter exit; all run ``shutdown`` here once):
  1. the placement waits for copies still reading the reader rings (pinned or on a GPU), then unregisters the
     rings: a ring must stay mapped while a DMA reads it;
  2. ``Supervisor.shutdown`` (idempotent): the zygote kills every child and reaps them (``Zygote.close``); the
     children's attach sockets go; then the slot table is repaired for the children known reaped (other ranks'
     children go on and need the slots ours held) and only then unmapped: repair needs the table and its lock fd;
  3. the control link closes last (``ControlLink.close``): leave the node session (the last rank deletes the
     queue's keys), close the client, release the embedded server (its last user shuts it down).
  A half-built loader undoes the same steps for what it opened: ``ControlLink.open`` its own, the Supervisor's
  constructor the zygote.
* Zygote: when the loader releases it (``Release``), it SIGKILLs its children, reaps them, removes their attach
  sockets, answers ``Released`` and waits, parked, for the process's next loader (NOTE [ Reused zygotes ] in
  procs/zygotereuse.py); when its channel closes (the trainer died, or ended a zygote it does not park), it does the
  same and exits without interpreter teardown (``procs/zygote.py``). A fork of the trainer never releases or ends it.
* Child: dies with the zygote (PR_SET_PDEATHSIG); a child that exits on its own closes its attach server, its
  maps and its Redis client (``ChildEnv.close``). It never repairs for itself: a dead child's slots are the next
  lock holder's to repair (NOTE [ Slot table ] in shm/slottable.py).
* Embedded server: stopped by the last live user's release; one whose starter died is found dead by the next
  user and its socket file removed.
"""

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
    (NOTE [ Shutdown ])."""
    with critical(deliver=False):  # whether closed, collected or run at exit: NOTE [ Ctrl-C ]
        try:
            if sup.forked_from is None:  # a fork's copy leaves the rings' copies to the parent (trainer/forks.py)
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
