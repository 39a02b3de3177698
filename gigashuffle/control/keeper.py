"""The embedded server's keeper: the process that owns a node's embedded Redis server while any loader uses it
(NOTE [ Embedded server ] in control/embedded.py).

Started by ``embedded.acquire`` as ``python -c RUN <package parent> <socket> <lock> <server argv...>``; a module of
the standard library, redis-py and a few small modules of this package (no torch), so it costs an interpreter start
and a check a second.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from gigashuffle.control.keys import EMBEDDED_USERS
from gigashuffle.control.plane import text
from gigashuffle.host.parentdeath import set_parent_death_signal
from gigashuffle.host.pids import pid_alive, process_start

CHECK_S = 1.0  # how often the keeper looks for live users (and how soon it sees its server exit: at once)
# What ``python -c`` runs: the keeper with the starting process's package on its path (a checkout on PYTHONPATH or
# added to sys.path by a script is not on the keeper's own).
RUN = "import sys; sys.path.insert(0, sys.argv[1]); from gigashuffle.control.keeper import main; main(sys.argv[2:])"


def user_token() -> str:
    """This process's entry in the server's set of users: its pid and start time (a reused pid is another process)
    and a unique part (one entry per loader)."""
    pid = os.getpid()
    return f"{pid}:{process_start(pid)}:{uuid.uuid4().hex}"


def user_alive(token: str) -> bool:
    """Whether the process behind a ``user_token`` still runs (tokens of older versions: ``pid:unique``)."""
    parts = token.split(":")
    try:
        pid = int(parts[0])
        start = int(parts[1]) if len(parts) == 3 else 0
    except ValueError:
        return False
    return pid_alive(pid) and (start == 0 or process_start(pid) == start)


def client(path: str) -> redis.Redis:
    # No retries: these calls probe whether a server answers, and SHUTDOWN's closed connection is its success.
    retry = Retry(NoBackoff(), 0)
    return redis.Redis(unix_socket_path=path, socket_timeout=5.0, socket_connect_timeout=1.0, retry=retry)


@contextlib.contextmanager
def node_lock(lock_path: str) -> Iterator[None]:
    """The node's flock that orders starting the server, joining it, leaving it, and the keeper's checks."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def forget_dead(server: redis.Redis) -> int:
    """Remove the users whose processes are gone; returns how many live ones are left. Under the node lock."""
    users = [text(u) for u in server.smembers(EMBEDDED_USERS)]
    dead = [u for u in users if not user_alive(u)]
    if dead:
        server.srem(EMBEDDED_USERS, *dead)
    return len(users) - len(dead)


def main(argv: list[str]) -> None:
    socket_path, lock_path, *server_argv = argv
    keeper = os.getpid()
    # preexec_fn is safe here: the keeper runs one thread. A SIGKILLed keeper takes its server along, by SIGTERM:
    # the server then unlinks its socket file.
    server = subprocess.Popen(
        server_argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        preexec_fn=lambda: set_parent_death_signal(keeper, signal.SIGTERM),  # noqa: PLW1509
    )
    probe = client(socket_path)
    try:
        while True:
            try:
                server.wait(timeout=CHECK_S)
                return  # shut down by the last user's release, or crashed
            except subprocess.TimeoutExpired:
                pass
            # Under the lock a user that joins has added its token (acquire holds it from its PING to its SADD;
            # the starter holds it while this process starts), so an empty set means that nobody uses the server.
            with node_lock(lock_path):
                try:
                    if forget_dead(probe):
                        continue
                except redis.RedisError:
                    continue  # not answering (yet, or stopped by a debugger): looked at again next time
                with contextlib.suppress(redis.ConnectionError):  # SHUTDOWN's success closes the connection
                    probe.shutdown(nosave=True)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=10.0)
    finally:
        probe.close()
        if server.poll() is None:
            server.terminate()
            server.wait()
