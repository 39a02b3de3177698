"""What a fork of the training process keeps of the loaders open in it, and what it may do with them.

NOTE [ Forks of the trainer ]
Training scripts fork: torch DataLoader workers (fork is Linux's default start method before Python 3.14), a
``multiprocessing`` pool, an ``os.fork()`` of their own. The child is a copy of the trainer with a copy of every
loader open in it, and it shares with the parent all that the kernel shares: the channels to the loader's processes
and its zygote, the Redis sockets, the fds and mappings of the node buffer and the slot table. A copy that used them
would act on the parent's loader:
- a ``next()`` read the parent's channels and took a batch a reader had announced to the parent: a ring slot, and
  its rows, lost to the parent;
- a close (the child's ``with`` block unwound, or the exit hook of trainer/teardown.py at the child's exit) went
  on to stop the parent's processes, repair the slot table for children still alive and leave the node session in
  Redis, until the zygote's channel, closed in the fork by procs/zygotereuse.py's hook, stopped it by chance;
- the buffer's fd and mapping (the rank that copies rows at a checkpoint maps the whole buffer; every trainer holds
  an fd of it to serve it) kept the buffer's memory, the size of the shuffle buffer, allocated after the parent's
  loader closed, for as long as the child lived: a persistent DataLoader worker's, the whole run.
So the ``os.register_at_fork`` hook below makes, in the child, every loader open in the parent a fork's copy
(``Supervisor.forget_in_fork``): it is closed for this process; its next use raises a ``GigashuffleError`` that
says whose loader it is (before any lock of it is taken: a parent thread may have held one at the fork), and its
close does nothing shared. The copy lets go of the node buffer and the slot table at once (their fds closed, their
mappings replaced by inaccessible reservations even under live views: ``SharedMemory.forget``). The reader rings
stay mapped in the child: the batches the parent held at the fork are views of them, and a child may read those.
The node lock's descriptions are closed by shm/nodelock.py's hook, the zygote's channel by procs/zygotereuse.py's.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

from gigashuffle.errors import GigashuffleError


class _Forgets(Protocol):
    def forget_in_fork(self, parent: int) -> None: ...


_OPEN: weakref.WeakSet[_Forgets] = weakref.WeakSet()
_pid = [os.getpid()]  # this process's, kept current by the hook (the parent a child forgets for)


def register(supervisor: _Forgets) -> None:
    """``supervisor`` becomes a fork's copy in every child forked while it lives."""
    _OPEN.add(supervisor)


def refuse_a_copy(queue_name: str, parent: int | None) -> None:
    """Raise in a fork's copy of a loader (``parent``: the trainer it was copied from; None: not a copy), before any
    lock of it is taken: a thread of the parent may have held one at the fork."""
    if parent is not None:
        raise GigashuffleError(
            f"the loader of queue {queue_name!r} belongs to process {parent}, and this process ({os.getpid()}) is a "
            "fork of it: a loader serves the process that opened it only. Open a loader in this process, or fork "
            "before opening one"
        )


def _after_fork_in_child() -> None:
    parent, _pid[0] = _pid[0], os.getpid()
    for supervisor in list(_OPEN):
        supervisor.forget_in_fork(parent)
    _OPEN.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
