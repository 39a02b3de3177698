"""The node lock: one ``flock`` per node buffer, on this process's own open file description of the slot table.

An fd received over SCM_RIGHTS (or inherited across ``fork``) shares the sender's open file description, and
``flock`` locks descriptions, not processes: holding it through such an fd would not exclude the sender. So each
process re-opens the memfd through ``/proc/self/fd`` on first use and locks that. The kernel drops the lock when
its holder dies, and there is no lock file to name, share or leak. Threads of one process share the description,
so a thread lock comes first.

NOTE [ The node lock under signals and fork ]
Every writer and reader of the node waits on this lock, so no path may leave it held in a process that lives on.
- Synchronous exceptions: every hold is released in a ``finally``; where an exception leaves it unknown whether
  the flock was taken, the path unlocks unconditionally (``LOCK_UN`` of a lock not held is a no-op) and then
  releases the thread lock.
- Asynchronous ones (a Python signal handler raising, e.g. KeyboardInterrupt on Ctrl-C): they can land at any
  bytecode, including between a ``flock`` returning and the ``try`` that would release it, or inside the cleanup
  itself, so no arrangement of ``finally`` blocks is enough. They are deferred instead, by the loader's one SIGINT
  mechanism (NOTE [ Ctrl-C ] in procs/interrupts.py): in the main thread (the only one a Python handler runs in),
  while SIGINT has a Python handler, each lock attempt and each hold is a ``blocking`` section of it, opened before
  the attempt and closed after the release, whatever handler the script installed, before or after the loader.
  Ctrl-C still ends a wait at once where every open section allows it (no section around, or only ``stats()``'s
  and ``evict()``'s): a timed wait delivers a deferred one between attempts, outside the section; an untimed one
  blocks in flock with the signal let through (``begin_wait``), so the exception (out of flock, or just after it
  returned with the lock) meets a cleanup that unlocks unconditionally and runs deferred again. Other threads, and
  processes where SIGINT is ignored (writers and readers: the zygote ignores it), take the lock as before, at the
  cost of one ``getsignal`` per acquire. Chosen over ``finally`` alone because that cannot be made safe at every
  bytecode, and over ``pthread_sigmask`` because Python runs handlers in the main thread whichever thread the
  kernel delivers to.
- Fork: ``flock`` belongs to the open file description, which a fork shares. A child that kept the parent's
  description would keep a lock its parent took through it alive after the parent died (and ``lock_holder()``
  would name the dead parent). So an ``os.register_at_fork`` hook closes every lock description in the child at
  once (the parent's lock is untouched: its own fd still refers to it) and gives the child fresh thread locks;
  the child opens its own description on first use.

NOTE [ Stripe locks ]
A table split into stripes (NOTE [ Stripes ] in shm/stripes.py) has one lock per stripe. ``flock`` locks a whole
file, so stripe 0 keeps the file's ``flock`` (a one-stripe table locks exactly as before, and a tool or test that
flocks the memfd still holds the node) and stripe ``k >= 1`` takes an open-file-description (OFD) write lock on byte
``k`` of the same memfd (``F_OFD_SETLKW``). OFD locks belong to the description as ``flock`` does, so everything
above holds for them unchanged: the kernel drops them when the holder dies, a fork's copy is closed by the hook, a
wait is interrupted by a signal as ``flock`` is, and ``flock`` and OFD locks never conflict with each other. What
differs: ``/proc/locks`` names no pid for an OFD lock, so each stripe's holder stores its pid in its stripe's
header while it holds the lock (``holder()`` trusts that word only while the kernel reports the byte locked).
"""

from __future__ import annotations

import _signal
import fcntl
import os
import signal
import struct
import threading
import time
import weakref

from gigashuffle.errors import NodeLockBusy
from gigashuffle.host.pids import describe_process, flock_holder

# The one SIGINT mechanism (stdlib only; the layer contract in pyproject.toml lets this module alone reach it).
from gigashuffle.procs import interrupts
from gigashuffle.shm.memfd import SharedMemory

# This process's pid and main thread, kept current across os.fork() by the hook below: os.getpid() is a system
# call, and every acquisition compares it with the pid that opened the lock description.
_pid = [os.getpid()]
_main_thread = [threading.main_thread().ident]
_LOCKS: weakref.WeakSet[NodeLock] = weakref.WeakSet()


def _deferring() -> bool:
    """True in the main thread while SIGINT has a Python handler: only then can an exception land anywhere."""
    return _get_ident() == _main_thread[0] and callable(_getsignal(_SIGINT))


# _signal.getsignal, not signal.getsignal: the latter wraps the answer in an enum, 0.5 us per acquire.
_get_ident, _getsignal, _SIGINT = threading.get_ident, _signal.getsignal, signal.SIGINT


def _after_fork_in_child() -> None:
    _pid[0] = os.getpid()
    _main_thread[0] = threading.get_ident()
    for lock in list(_LOCKS):
        lock._forget_parent()


os.register_at_fork(after_in_child=_after_fork_in_child)


class NodeLock:
    """The lock of the slot table in ``memory`` (the memfd must stay open while the lock is used)."""

    def __init__(self, memory: SharedMemory, index: int = 0, owner: memoryview | None = None) -> None:
        self._memory = memory
        self.index = index  # 0: the file's flock; k >= 1: an OFD lock on byte k (NOTE [ Stripe locks ])
        self._owner = owner  # a word of the stripe's header: this holder's pid while it holds an OFD lock
        self._set_lock = _ofd_arg(fcntl.F_WRLCK, index)
        self._unset_lock = _ofd_arg(fcntl.F_UNLCK, index)
        self._thread_lock = threading.Lock()
        self._fd = -1
        self._opened_by = -1  # the pid that opened self._fd
        self._deferring = False  # whether the current hold runs with SIGINT held back
        self._finalizer = _fd_finalizer(self, self._fd)
        _LOCKS.add(self)

    def acquire(self, wait_s: float | None = None) -> None:
        """Take the lock; with ``wait_s``, raise NodeLockBusy if it stays held that long."""
        deferring = _deferring()
        if wait_s is None and not deferring:  # no asynchronous exception can land here: the hot path, inlined
            self._thread_lock.acquire()
            try:
                if self._opened_by != _pid[0]:
                    self._open_own_description()
                self._lock_wait()
            except BaseException:
                self._unlock_unknown()
                raise
            return
        deadline = None if wait_s is None else time.monotonic() + wait_s
        pause = 0.001
        while True:
            counted = deferring and interrupts.enter(blocking=True)
            taken = False
            try:
                taken = self._take(blocking=wait_s is None, deferred=counted)
            finally:
                if not taken:
                    interrupts.leave(counted, blocking=True)  # nothing is held here: a Ctrl-C ends the wait now
            if taken:
                self._deferring = counted
                return
            interrupts.interrupt_point()  # inside the caller's blocking section (stats(), evict()), if any
            if deadline is not None and time.monotonic() >= deadline:
                holder = self.holder()
                raise NodeLockBusy(wait_s or 0.0, "an unknown process" if holder is None else describe_process(holder))
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _take(self, blocking: bool, deferred: bool = False) -> bool:
        """One attempt; ``deferred``: in the main thread with SIGINT held back, where the thread lock is only
        tried (a wait for it would hold Ctrl-C back) and a blocking flock waits with SIGINT let through."""
        if not self._thread_lock.acquire(blocking and not deferred):
            return False
        try:
            if self._opened_by != _pid[0]:
                self._open_own_description()
            if not blocking:
                self._lock_try()
            elif deferred:
                interrupts.begin_wait()  # a Ctrl-C's exception ends the wait: NOTE above
                try:
                    self._lock_wait()
                finally:
                    interrupts.end_wait()
            else:
                self._lock_wait()
            return True
        except BlockingIOError:
            self._thread_lock.release()
            return False
        except BaseException:
            self._unlock_unknown()
            raise

    def _unlock_unknown(self) -> None:
        """Whether the flock was taken is unknown: unlock regardless (a no-op if not held), then the thread lock."""
        try:
            if self._fd >= 0:
                self._unlock()
        finally:
            self._thread_lock.release()

    # The three lock calls (NOTE [ Stripe locks ]); an OFD lock raises BlockingIOError when busy, as flock does.
    def _lock_wait(self) -> None:
        if self.index:
            fcntl.fcntl(self._fd, _F_OFD_SETLKW, self._set_lock)
        else:
            fcntl.flock(self._fd, fcntl.LOCK_EX)

    def _lock_try(self) -> None:
        if self.index:
            fcntl.fcntl(self._fd, _F_OFD_SETLK, self._set_lock)
        else:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _unlock(self) -> None:
        if self.index:
            fcntl.fcntl(self._fd, _F_OFD_SETLK, self._unset_lock)
        else:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def release(self) -> None:
        try:
            self._unlock()
        finally:
            self._thread_lock.release()
            if self._deferring:
                self._deferring = False
                interrupts.leave(True, blocking=True)  # may raise a deferred KeyboardInterrupt: the lock is free

    def holder(self) -> int | None:
        """The pid holding the lock now (from ``/proc/locks``, or for an OFD lock the owner word while the kernel
        reports the byte locked: NOTE [ Stripe locks ]), or None."""
        fd = self._memory.fd
        if fd is None:
            return None
        if not self.index:
            return flock_holder(fd)
        probe = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)  # a description of its own: sees every holder
        try:
            answer = fcntl.fcntl(probe, _F_OFD_GETLK, _ofd_arg(fcntl.F_WRLCK, self.index))
        finally:
            os.close(probe)
        if struct.unpack(_FLOCK_FORMAT, answer)[0] == fcntl.F_UNLCK:
            return None
        owner = 0 if self._owner is None else int(self._owner[0])
        return owner or None

    def close(self) -> None:
        self._finalizer()
        self._fd = self._opened_by = -1

    def _forget_parent(self) -> None:
        """In a forked child: drop the parent's lock description and any thread lock a parent thread held."""
        self._thread_lock = threading.Lock()
        self._deferring = False
        inherited = self._finalizer.detach()
        if inherited is not None:
            _close_fd(inherited[2][0])
        self._fd = -1
        self._opened_by = -1

    def _open_own_description(self) -> None:
        inherited = self._finalizer.detach()
        if inherited is not None:  # a closed lock's, or one opened before a fork the hook did not see
            _close_fd(inherited[2][0])
        if self._memory.fd is None:
            raise ValueError("the slot table is closed")
        self._fd = os.open(f"/proc/self/fd/{self._memory.fd}", os.O_RDWR | os.O_CLOEXEC)
        self._opened_by = _pid[0]
        self._finalizer = _fd_finalizer(self, self._fd)


# struct flock on Linux x86-64/aarch64: l_type, l_whence (short), l_start, l_len (off_t), l_pid (int, 0 for OFD).
_FLOCK_FORMAT = "hhqqi4x"
_F_OFD_GETLK, _F_OFD_SETLK, _F_OFD_SETLKW = 36, 37, 38  # fcntl.F_OFD_* where Python exposes them (3.9+ on Linux)
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", _F_OFD_GETLK)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", _F_OFD_SETLK)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", _F_OFD_SETLKW)


def _ofd_arg(kind: int, index: int) -> bytes:
    return struct.pack(_FLOCK_FORMAT, kind, os.SEEK_SET, index, 1, 0)


def _fd_finalizer(lock: NodeLock, fd: int) -> weakref.finalize:  # type: ignore[type-arg]
    # Not at exit: a finalizer of the process's teardown (the loader's shutdown repairs the table) may take the
    # lock after weakref's exit hook ran the newer finalizers; the kernel closes the fd when the process ends.
    finalizer = weakref.finalize(lock, _close_fd, [fd])
    finalizer.atexit = False
    return finalizer


def _close_fd(holder: list[int]) -> None:
    if holder[0] >= 0:
        os.close(holder[0])
        holder[0] = -1
