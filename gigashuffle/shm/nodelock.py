"""The node lock: one ``flock`` per node buffer, on this process's own open file description of the slot table.

An fd received over SCM_RIGHTS (or inherited across ``fork``) shares the sender's open file description, and
``flock`` locks descriptions, not processes: holding it through such an fd would not exclude the sender. So each
process re-opens the memfd through ``/proc/self/fd`` once (and again after a fork) and locks that. The kernel
drops the lock when its holder dies, and there is no lock file to name, share or leak. Threads of one process
share the description, so a thread lock comes first.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
import weakref

from gigashuffle.errors import NodeLockBusy
from gigashuffle.host.pids import describe_process, flock_holder
from gigashuffle.shm.buffer import SharedMemory

# This process's pid, kept current across os.fork() by the hook below: os.getpid() is a system call, and every
# acquisition compares it with the pid that opened the lock description (5% of a writer's time here).
_pid = [os.getpid()]


def _note_fork() -> None:
    _pid[0] = os.getpid()


os.register_at_fork(after_in_child=_note_fork)


class NodeLock:
    """The lock of the slot table in ``memory`` (the memfd must stay open while the lock is used)."""

    def __init__(self, memory: SharedMemory) -> None:
        self._memory = memory
        self._thread_lock = threading.Lock()
        self._fd = -1
        self._opened_by = -1  # the pid that opened self._fd
        self._finalizer = weakref.finalize(self, _close_fd, [self._fd])

    def acquire(self, wait_s: float | None = None) -> None:
        """Take the lock; with ``wait_s``, raise NodeLockBusy if it stays held that long."""
        self._thread_lock.acquire()
        try:
            if self._opened_by != _pid[0]:
                self._open_own_description()
            if wait_s is None:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            else:
                self._flock_within(wait_s)
        except BaseException:
            self._thread_lock.release()
            raise

    def release(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def holder(self) -> int | None:
        """The pid holding the lock now (from ``/proc/locks``), or None."""
        fd = self._memory.fd
        return None if fd is None else flock_holder(fd)

    def close(self) -> None:
        self._finalizer()
        self._opened_by = -1

    def _open_own_description(self) -> None:
        inherited = self._finalizer.detach()
        if inherited is not None:  # the parent's description: holding it could keep the parent's lock
            _close_fd(inherited[2][0])
        if self._memory.fd is None:
            raise ValueError("the slot table is closed")
        self._fd = os.open(f"/proc/self/fd/{self._memory.fd}", os.O_RDWR | os.O_CLOEXEC)
        self._opened_by = _pid[0]
        self._finalizer = weakref.finalize(self, _close_fd, [self._fd])

    def _flock_within(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        pause = 0.001
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = self.holder()
                    who = "an unknown process" if holder is None else describe_process(holder)
                    raise NodeLockBusy(wait_s, who) from None
                time.sleep(pause)
                pause = min(2 * pause, 0.05)


def _close_fd(holder: list[int]) -> None:
    if holder[0] >= 0:
        os.close(holder[0])
        holder[0] = -1
