"""Leak accounting for tests: what a test left behind that outlives the objects it created.

A shuffle buffer spread over processes, shared memory and Redis leaks in ways no Python object graph shows:
a never-unlinked ``/dev/shm`` segment survives the job, a reader process outlives its loader, a slot key
stays in Redis. Tests take a :func:`snapshot` before, tear down, then call :func:`assert_no_leaks`.

``/dev/shm`` is shared by every process on the machine, including other xdist workers, so tests running in
parallel should pass ``shm_pattern`` naming only their own segments (e.g. a glob on a unique queue name).

gigashuffle's buffers are anonymous memfds: a leaked one holds no name and, once its fd is closed, no fd either,
only a mapping, so ``/proc/self/maps`` is read for them. Zombies count (a parent that never reaps its child is a
leak), and :func:`become_subreaper` makes the test process inherit orphaned grandchildren, so a process whose
parent died before it is still counted while it lives.
"""

from __future__ import annotations

import ctypes
import fnmatch
import gc
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import stat
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import psutil
from redis_servers import managed_pids

from gigashuffle.procs.zygotereuse import parked_zygote_fd, parked_zygote_pid

SHM_DIR = Path("/dev/shm")
_SEM_PREFIX = "sem."
# Per-interpreter singletons that multiprocessing starts on first use and keeps until exit: they are not a
# test's leak, and counting them would fail whichever test happened to start them first.
_SINGLETON_HELPERS = (
    "from multiprocessing.resource_tracker import main",
    "from multiprocessing.forkserver import main",
)


@dataclass(frozen=True, order=True)
class ChildProcess:
    """A live descendant process; identity is (pid, start time) so a recycled pid is a different process."""

    pid: int
    create_time: float
    cmdline: str = field(compare=False)

    def __str__(self) -> str:
        return f"pid {self.pid}: {self.cmdline}"


@dataclass(frozen=True)
class Snapshot:
    """Resources visible at one moment; every field is a set so that :func:`diff` is set difference."""

    shm: frozenset[str] = frozenset()
    semaphores: frozenset[str] = frozenset()
    fds: frozenset[tuple[int, str]] = frozenset()
    children: frozenset[ChildProcess] = frozenset()
    sockets: frozenset[str] = frozenset()
    redis_keys: frozenset[str] = frozenset()
    mappings: frozenset[str] = frozenset()


_PR_SET_CHILD_SUBREAPER = 36
MEMFD_MAPPING = "/memfd:gigashuffle"


def become_subreaper() -> None:
    """Make this process adopt orphaned descendants (instead of init), so the leak check still sees them."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _memfd_mappings() -> frozenset[str]:
    """This process's mappings of gigashuffle memfds (``start-end path``); one left after close() is a leak."""
    gc.collect()  # a batch the test dropped may still sit in a reference cycle; only live views should count
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if MEMFD_MAPPING in line:
                parts = line.split(maxsplit=5)
                found.add(f"{parts[0]} {parts[5].strip() if len(parts) > 5 else ''}")
    return frozenset(found)


def _shm_entries(shm_pattern: str) -> tuple[frozenset[str], frozenset[str]]:
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:  # not Linux
        return frozenset(), frozenset()
    shm, sems = set(), set()
    for name in names:
        if name.startswith(_SEM_PREFIX):
            # Match semaphores without their "sem." prefix, so one pattern covers a library's segments
            # and semaphores that share a name prefix.
            if fnmatch.fnmatchcase(name[len(_SEM_PREFIX) :], shm_pattern):
                sems.add(name)
        elif fnmatch.fnmatchcase(name, shm_pattern):
            shm.add(name)
    return frozenset(shm), frozenset(sems)


def _singleton_fds() -> set[int]:
    # The pipe to the resource tracker, the fork server's liveness pipe and the parked zygote's channel belong to
    # those singletons and live as long as they do. Private attributes, hence getattr with defaults: a rename only
    # costs precision.
    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    forkserver = getattr(multiprocessing.forkserver, "_forkserver", None)
    fds = {getattr(tracker, "_fd", None), getattr(forkserver, "_forkserver_alive_fd", None), parked_zygote_fd()}
    return {fd for fd in fds if isinstance(fd, int)}


def _singleton_pids() -> set[int]:
    # By pid as well as by command line: a helper caught between its fork and its exec still shows the parent's
    # command line (seen in CI: the resource tracker, started by a test's first SharedMemory, counted as a leak).
    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    forkserver = getattr(multiprocessing.forkserver, "_forkserver", None)
    # gigashuffle's parked zygote is one per process too (NOTE [ Reused zygotes ] in procs/zygotereuse.py).
    pids = {getattr(tracker, "_pid", None), getattr(forkserver, "_forkserver_pid", None), parked_zygote_pid()}
    return {pid for pid in pids if isinstance(pid, int)}


def open_fds() -> frozenset[tuple[int, str]]:
    """This process's fds and what each points at, less those of multiprocessing's per-interpreter helpers."""
    fd_dir = "/proc/self/fd"
    skip = _singleton_fds()
    found = set()
    for name in os.listdir(fd_dir):
        if int(name) in skip:
            continue
        try:
            found.add((int(name), os.readlink(f"{fd_dir}/{name}")))
        except OSError:  # the fd listdir itself used, already closed again
            continue
    return frozenset(found)


def memfd_fds() -> frozenset[int]:
    """This process's fds on memfds of any name: what a test that hands memfds around checks it closed. Other fds
    are left out, since a thread of the test (an attach server) may still be closing a socket it just used."""
    return frozenset(fd for fd, target in open_fds() if target.startswith("/memfd:"))


def _own_children() -> set[int]:
    """Children this process started itself and has not reaped yet (their exit status is theirs to collect)."""
    pids = {p.pid for p in multiprocessing.active_children()}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__, which wakes lazy module proxies (torch's
        # deprecated aliases warn when touched).
        if issubclass(type(obj), subprocess.Popen) and obj.returncode is None:
            pids.add(obj.pid)
    return pids


def _reap_adopted_zombie(pid: int) -> bool:
    """Reap a dead orphan that the subreaper adopted; False if it is not ours to reap."""
    try:
        reaped, _status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return reaped == pid


def _children() -> frozenset[ChildProcess]:
    skip = managed_pids() | _singleton_pids()
    me = os.getpid()
    own: set[int] | None = None  # computed only when an adopted zombie shows up (gc walk)
    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.pid in skip:
                continue
            if proc.status() == psutil.STATUS_ZOMBIE:
                if proc.ppid() == me:
                    own = _own_children() if own is None else own
                    # An orphan adopted by the subreaper has exited: nothing of it is left once reaped. A zombie of
                    # a Popen the test has not waited for yet stays counted until the test waits.
                    if proc.pid not in own and _reap_adopted_zombie(proc.pid):
                        continue
                found.add(ChildProcess(proc.pid, proc.create_time(), f"zombie (parent {proc.ppid()}): {proc.name()}"))
                continue
            cmdline = " ".join(proc.cmdline()) or proc.name()
            if any(helper in cmdline for helper in _SINGLETON_HELPERS):
                continue
            found.add(ChildProcess(proc.pid, proc.create_time(), cmdline))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):  # exited (or was reaped) while we looked
            continue
    return frozenset(found)


def _socket_files(runtime_dir: str | os.PathLike[str]) -> frozenset[str]:
    found = set()
    for dirpath, _dirnames, filenames in os.walk(runtime_dir):
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    found.add(path)
            except FileNotFoundError:
                continue
    return frozenset(found)


def _redis_keys(client: Any, pattern: str) -> frozenset[str]:
    # SCAN rather than KEYS: it does not block the server, and redis-py's cluster client runs it on every
    # primary, so the same call covers a single server and a cluster.
    keys = client.scan_iter(match=pattern, count=1000)
    return frozenset(k.decode() if isinstance(k, bytes) else str(k) for k in keys)


def snapshot(
    redis_client: Any = None,
    key_pattern: str | None = None,
    runtime_dir: str | os.PathLike[str] | None = None,
    *,
    shm_pattern: str = "*",
) -> Snapshot:
    """Capture shm segments, semaphores, this process's fds and memfd mappings, descendants (zombies too),
    runtime sockets, Redis keys.

    ``redis_client`` is a ``redis.Redis`` or ``redis.cluster.RedisCluster``; ``key_pattern`` (a SCAN glob,
    default ``*``) limits the keys. Fixture-managed Redis servers, multiprocessing's resource tracker and
    fork server (processes and their pipes) are not counted.
    """
    if key_pattern is not None and redis_client is None:
        raise ValueError("key_pattern needs a redis_client")
    # Redis first: its SCAN may open the client's first connection, which must then already be in the fd
    # listing, or the next snapshot would report the client's own socket as a leak.
    keys = _redis_keys(redis_client, key_pattern or "*") if redis_client is not None else frozenset()
    shm, sems = _shm_entries(shm_pattern)
    return Snapshot(
        shm=shm,
        semaphores=sems,
        fds=open_fds(),
        children=_children(),
        sockets=_socket_files(runtime_dir) if runtime_dir is not None else frozenset(),
        redis_keys=keys,
        mappings=_memfd_mappings(),
    )


def diff(before: Snapshot, after: Snapshot) -> dict[str, list[Any]]:
    """What ``after`` has that ``before`` had not, by category; categories with nothing new are omitted."""
    new: dict[str, list[Any]] = {}
    for f in fields(Snapshot):
        added = getattr(after, f.name) - getattr(before, f.name)
        if added:
            new[f.name] = sorted(added)
    return new


def _describe(item: Any) -> str:
    if isinstance(item, tuple) and len(item) == 2:
        return f"fd {item[0]} -> {item[1]}"
    return str(item)


def format_leaks(leaked: Mapping[str, Iterable[Any]]) -> str:
    """Human-readable listing of a :func:`diff` result, one item per line under its category."""
    lines = []
    for category, items in leaked.items():
        described = [_describe(item) for item in items]
        lines.append(f"  {category} ({len(described)}):")
        lines.extend(f"    - {d}" for d in described)
    return "\n".join(lines)


def assert_no_leaks(
    before: Snapshot,
    deadline_s: float = 5.0,
    *,
    redis_client: Any = None,
    key_pattern: str | None = None,
    runtime_dir: str | os.PathLike[str] | None = None,
    shm_pattern: str = "*",
    poll_interval_s: float = 0.05,
) -> None:
    """Poll until nothing is new relative to ``before``; at the deadline raise AssertionError listing leaks.

    Pass the same arguments as to :func:`snapshot`. The grace period lets processes that are already exiting
    finish, and asynchronous cleanup (a worker unlinking its segment on the way out) land.
    """
    deadline = time.monotonic() + deadline_s
    while True:
        leaked = diff(
            before,
            snapshot(redis_client, key_pattern, runtime_dir, shm_pattern=shm_pattern),
        )
        if not leaked:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"leaked after {deadline_s:.1f} s grace:\n{format_leaks(leaked)}")
        time.sleep(poll_interval_s)
