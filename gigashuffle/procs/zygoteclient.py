"""The trainer's view of its children: a zygote handle that spawns them and reports how they ended."""

from __future__ import annotations

import logging
import multiprocessing.spawn
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass

from gigashuffle.errors import GigashuffleError
from gigashuffle.procs import zygotereuse
from gigashuffle.procs.channel import Channel, ChannelClosed
from gigashuffle.procs.messages import Kill, Release, Released, Role, Spawn, ZygoteEvent
from gigashuffle.shm.buffer import BatchRing
from gigashuffle.shm.counters import ChildCounters

log = logging.getLogger(__name__)

_ZYGOTE_EXIT_TIMEOUT_S = 10.0


@dataclass
class ChildProcess:
    """One writer or reader, as the trainer tracks it."""

    role: Role
    index: int
    seq: int
    channel: Channel
    restarts: int = 0
    pid: int | None = None
    proc_id: str = ""
    exitcode: int | None = None
    error_type: str = ""
    traceback_text: str = ""
    ring: BatchRing | None = None
    counters: ChildCounters | None = None  # its metrics page (NOTE [ Child counters ] in shm/counters.py)
    held: int = 0  # batches of this child's ring that the caller still holds
    generation: str = ""  # the node session this child quotes
    attached: bool = False  # it has the node buffer mapped (so a new session costs it nothing)
    superseded: bool = False  # killed because it started under a session that is gone: start it again for free

    @property
    def alive(self) -> bool:
        return self.exitcode is None


# Copies of at least this many bytes bypass the caches (non-temporal stores) in the zygote and its children.
_NON_TEMPORAL_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
_NON_TEMPORAL_BYTES = 64 * 1024


def _streaming_copies(env: dict[str, str]) -> dict[str, str]:
    """``GLIBC_TUNABLES`` for the zygote: rows of 64 KB and more are copied with non-temporal stores.

    A writer copies each row into the node buffer, where a reader fetches it much later: caching the destination
    only costs a read of every line before it is overwritten. glibc picks streaming stores only above a threshold
    it derives from the cache size (megabytes; on this 2-core VM, which reports a 480 MB L3, never), so image-sized
    rows were copied through the cache (its effect on writer CPU per row: docs/benchmarks.md). x86-64 only
    (other machines ignore the setting); a threshold the user set already wins.
    """
    tunables = env.get("GLIBC_TUNABLES", "")
    if platform.machine() not in ("x86_64", "AMD64") or _NON_TEMPORAL_TUNABLE in tunables:
        return {}
    ours = f"{_NON_TEMPORAL_TUNABLE}={_NON_TEMPORAL_BYTES}"
    return {"GLIBC_TUNABLES": f"{tunables}:{ours}" if tunables else ours}


class Zygote:
    """Starts the zygote process, or takes the one a closed loader of this process parked, and asks it for children
    (NOTE [ Why a zygote ] in ``procs/zygote.py``, NOTE [ Reused zygotes ] in ``procs/zygotereuse.py``).

    Nothing here waits for a fresh zygote: spawn requests queue up in the channel while it imports torch, and its
    replies (``Spawned``, ``Exited``) are read by whoever polls ``events()``.
    """

    def __init__(self, title: str) -> None:
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        env.update(_streaming_copies(env))
        preparation = multiprocessing.spawn.get_preparation_data("gigashuffle-zygote")
        preparation.pop("authkey", None)  # multiprocessing's key is not needed and should not travel
        # The zygote takes the trainer's sys.path and working directory but never runs its main module: a script
        # without a main guard would build a second loader there. What __main__ defines travels by value instead
        # (NOTE [ Pickling the dataset ] in procs/pickling.py).
        preparation.pop("init_main_from_path", None)
        preparation.pop("init_main_from_name", None)
        preparation["gigashuffle_title"] = title
        preparation["gigashuffle_env"] = env
        self._key = zygotereuse.start_key(sys.executable, package_root, env)
        self._next_seq = 0
        self._done = False
        self._trainer_pid = os.getpid()  # a forked copy of this object is not the zygote's trainer
        parked = zygotereuse.PARKING.take(self._key, preparation)
        if parked is not None:
            self._proc, self.channel = parked.process, parked.channel
            self.reused = True
        else:
            ours, theirs = Channel.pair()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "gigashuffle.procs.zygote", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=env,
            )
            theirs.close()
            self.channel = zygotereuse.trainer_end(ours)
            self.reused = False
            ours.send(preparation)
        self.pid = self._proc.pid

    def spawn(self, payload: bytes, title: str) -> tuple[int, Channel]:
        """Ask for a child running ``child.child_main(payload)``; returns a request number and its channel.

        The child's pid arrives later as ``Spawned(seq, pid)`` from ``events()``.
        """
        ours, theirs = Channel.pair()
        seq = self._next_seq
        self._next_seq += 1
        try:
            self.channel.send(Spawn(seq, payload, title), (theirs.fileno(),))
        finally:
            theirs.close()
        return seq, ours

    def kill(self, seq: int) -> None:
        """SIGKILL the child of spawn request ``seq`` if it still runs; its exit arrives as an ``Exited`` event."""
        self.channel.send(Kill(seq))

    def events(self) -> list[ZygoteEvent]:
        """Messages the zygote sent since the last call; raises if the zygote itself died."""
        found = []
        try:
            while self.channel.poll(0):
                message, _ = self.channel.recv()
                found.append(message)
        except (ChannelClosed, ConnectionError):
            code = self._proc.wait()
            raise GigashuffleError(
                f"the gigashuffle zygote (pid {self.pid}) exited with code {code}; every loader process is gone "
                "(see its output above)"
            ) from None
        return found

    def close(self) -> bool:
        """Kill every child and release the zygote (parked for this process's next loader, or ended); safe to call
        twice. True when the zygote reaped every child (it answered ``Released``, or exited on its own): then none
        of them runs another instruction. False when it was gone already or had to be killed: its children die of
        PR_SET_PDEATHSIG, but some may still be running."""
        if self._done or self._proc.returncode is not None:
            return False
        self._done = True
        if os.getpid() != self._trainer_pid:
            return False  # a fork of the trainer (its copy of the loader at its exit): the zygote is not its to end
        deadline = time.monotonic() + _ZYGOTE_EXIT_TIMEOUT_S
        if self._released(deadline):
            parked = zygotereuse.ParkedZygote(self._proc, self.channel, self._key)
            if not zygotereuse.PARKING.park(parked):
                zygotereuse.end(parked)
            return True
        code = zygotereuse.close_and_wait(self._proc, self.channel, max(0.0, deadline - time.monotonic()))
        return code == 0  # it exits 0 only after reaping every child; killed (by us or anyone), it reaped none

    def _released(self, deadline: float) -> bool:
        """Ask the zygote to reap every child and wait for its ``Released`` (events before it are dropped: the
        loader is closing)."""
        try:
            self.channel.send(Release())
            while self.channel.poll(max(0.0, deadline - time.monotonic())):
                message, _ = self.channel.recv()
                if isinstance(message, Released):
                    return True
        except (ChannelClosed, OSError) as exc:
            log.debug("gigashuffle zygote %d did not release: %s", self.pid, exc)
        return False
