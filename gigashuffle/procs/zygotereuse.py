"""A closed loader's zygote, parked for the same process's next loader.

NOTE [ Reused zygotes ]
A zygote costs an interpreter start and ``import torch``: about 1.4 s of CPU and most of a loader's start-up on a
2-core machine, paid again by every loader a process makes (a validation loader, a loader per epoch or per test).
So a loader that closes releases its zygote instead of ending it: the zygote kills and reaps every child of that
loader, answers ``Released``, and waits for the next loader's preparation. Its own state is a fresh interpreter's
with torch and gigashuffle imported; it never runs a child's code (children run after fork), so a reused zygote forks
the same children a fresh one would. Rules:
  - one zygote is parked per process; a second one released while one is parked ends;
  - reused only by the process that parked it (a trainer's forked child shares the socket, never the zygote) and
    only when what the zygote read when it started is what a fresh one would read now: the Python executable,
    the package root, and the environment variables read at interpreter, libc or torch start-up (``_READ_AT_START``).
    Every other variable is applied before the next fork (``os.environ`` is the loader's), as are ``sys.path`` and
    the working directory (``multiprocessing.spawn.prepare``);
  - a reused zygote answers ``Prepared`` before it is used: one that died while parked is ended and a fresh one
    started, never handed to a loader;
  - a parked zygote ends when the process exits (``atexit``: closed and waited for) or dies (its channel's EOF).
    Until then it keeps its own memory (about 150 MB unshared on this VM: its interpreter and torch); 40 loaders
    made one after the other in one process left it at the same fds and memory as the first;
  - a fork of the trainer (a DataLoader worker, a ``multiprocessing`` fork) closes its copy of every zygote's
    channel as it starts (``_after_fork_in_child``): a zygote, parked or serving, learns of its trainer's exit or
    death only by its channel's EOF, which no longer comes while any copy is open. Otherwise a trainer that exited
    waited 5 s and killed its parked zygote, and a SIGKILLed trainer's zygote and loader children lived as long as
    any of its forks.
``Zygote.close()`` vouches for the children's deaths only after ``Released`` (or the zygote's exit), as before.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import threading
import weakref
from dataclasses import dataclass

from gigashuffle.procs.channel import Channel, ChannelClosed
from gigashuffle.procs.messages import Prepared

log = logging.getLogger(__name__)

# Environment variables read when the zygote starts (Python, the C library and its allocator, torch and its thread
# pools, gigashuffle's fail points): a zygote is reused only when these are what they were when it started.
_READ_AT_START = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "LC_", "LANG", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "TORCH",
                  "PYTORCH_", "CUDA_", "NVIDIA_", "GIGASHUFFLE_FAILPOINTS")  # fmt: skip
# How long a reused zygote may take to answer ``Prepared`` before a fresh one is started instead.
PREPARED_TIMEOUT_S = 5.0
_EXIT_TIMEOUT_S = 5.0


@dataclass
class ParkedZygote:
    process: subprocess.Popen[bytes]
    channel: Channel
    key: tuple[str, ...]


def start_key(executable: str, package_root: str, env: dict[str, str]) -> tuple[str, ...]:
    """What a zygote read when it started, and must match for reuse."""
    read = sorted(f"{k}={v}" for k, v in env.items() if k.startswith(_READ_AT_START))
    return (executable, package_root, *read)


class _Parking:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parked: ParkedZygote | None = None
        self._owner = 0  # the pid that parked it: a forked child of the trainer must not use it
        self._exiting = False
        atexit.register(self.close)

    def park(self, zygote: ParkedZygote) -> bool:
        """Keep ``zygote`` (released) for the next loader; False when it is not kept (the caller ends it)."""
        with self._lock:
            if self._exiting or (self._parked is not None and self._owner == os.getpid()):
                return False
            self._parked, self._owner = zygote, os.getpid()
            return True

    def take(self, key: tuple[str, ...], preparation: dict[str, object]) -> ParkedZygote | None:
        """The parked zygote, told ``preparation``, if it was started like a fresh one would be now."""
        with self._lock:
            parked, self._parked = self._parked, None
            if parked is None or self._owner != os.getpid():
                return None  # a fork's copy of the parent's socket: left alone
        if parked.key != key or parked.process.poll() is not None:
            end(parked)
            return None
        try:
            parked.channel.send({**preparation, "gigashuffle_answer": True})
            if parked.channel.poll(PREPARED_TIMEOUT_S):
                answer, _ = parked.channel.recv()
                if isinstance(answer, Prepared):
                    return parked
        except (ChannelClosed, OSError) as exc:
            log.debug("parked zygote %d did not take a new loader: %s", parked.process.pid, exc)
        end(parked)
        return None

    def parked(self) -> ParkedZygote | None:
        with self._lock:
            return self._parked if self._owner == os.getpid() else None

    def after_fork_in_child(self) -> None:
        """Another thread of the parent may have held the lock at the fork: the child gets a fresh one, or its first
        loader would wait on it forever."""
        self._lock = threading.Lock()

    def close(self) -> None:
        """End the parked zygote and park none from now on (at the process's exit: nothing of the loaders
        outlives it)."""
        with self._lock:
            self._exiting = True
        self.end_parked()

    def end_parked(self) -> None:
        """End the parked zygote, if any: the next loader starts a fresh one."""
        with self._lock:
            parked, self._parked = self._parked, None
        if parked is not None and self._owner == os.getpid():
            end(parked)


def end(zygote: ParkedZygote) -> None:
    """End a released zygote (it has no children)."""
    close_and_wait(zygote.process, zygote.channel, _EXIT_TIMEOUT_S)


def close_and_wait(process: subprocess.Popen[bytes], channel: Channel, timeout_s: float) -> int | None:
    """Close the trainer's end of a zygote's channel and wait up to ``timeout_s`` for the zygote to exit (it kills
    and reaps its children first); killed past that. Its exit code, or None when it had to be killed."""
    channel.close()
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("gigashuffle zygote %d did not exit; killing it", process.pid)
        process.kill()
        process.wait()
        return None


PARKING = _Parking()

# This process's end of every zygote's channel it started or took, serving or parked (NOTE [ Reused zygotes ]).
_CHANNELS: weakref.WeakSet[Channel] = weakref.WeakSet()


def trainer_end(channel: Channel) -> Channel:
    """Note ``channel`` as this process's end of a zygote's channel, so that its forks close their copies."""
    _CHANNELS.add(channel)
    return channel


def _after_fork_in_child() -> None:
    # The child's one thread. The child's copies of the zygote objects stay, closed: its atexit and close() calls
    # leave a zygote that is not its own alone already (they check the pid).
    PARKING.after_fork_in_child()
    for channel in list(_CHANNELS):
        channel.close()
    _CHANNELS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def parked_zygote_pid() -> int | None:
    """The pid of this process's parked zygote, if any (for leak checks: it is no loader's)."""
    parked = PARKING.parked()
    return None if parked is None else parked.process.pid


def parked_zygote_fd() -> int | None:
    """This process's end of its parked zygote's channel, if any (for leak checks: it is no loader's)."""
    parked = PARKING.parked()
    return None if parked is None else parked.channel.fileno()
