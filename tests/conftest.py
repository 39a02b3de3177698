"""Suite-wide fixtures: a private Redis per xdist worker, a lazily started cluster, isolated runtime dirs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The helper modules next to this file are imported as top-level modules; put their directory on sys.path
# explicitly so that this keeps working whatever the import mode or a later tests/__init__.py.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import leaks  # noqa: E402
from lean import LeanProcess  # noqa: E402
from redis_servers import ManagedRedis, RedisCluster, find_server_binary, start_redis  # noqa: E402

RUNTIME_DIR_ENV = "GIGASHUFFLE_RUNTIME_DIR"

# The Ctrl-C tests send SIGINT and expect what a terminal's Ctrl-C does. A shell without job control starts a
# background command (`pytest ... &` in a script, `nohup`) with SIGINT ignored, which Python and every process it
# starts inherit: the suite would then test an ignored signal instead (ten tests failed so). Each test process
# (xdist worker included) restores Python's handler; the processes the tests start get SIGINT's default from it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_report_header() -> str:
    # Which server the run used matters when a Lua or cluster behaviour differs between Redis and Valkey.
    try:
        binary = find_server_binary()
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return f"redis server: unavailable ({exc})"
    return f"redis server: {binary}: {version.strip()}"


def _private_dir(prefix: str) -> Path:
    # mkdtemp makes the directory 0700. It lives directly in the temp dir rather than under tmp_path so that
    # unix socket paths inside it stay well below the 107-byte sun_path limit.
    return Path(tempfile.mkdtemp(prefix=prefix))


@pytest.fixture(scope="session", autouse=True)
def _adopt_orphans() -> None:
    """Orphaned grandchildren (a child's child whose parent died) are reparented to this test process instead of
    init, so the leak checks still see them while they live (tests/leaks.py)."""
    leaks.become_subreaper()


@pytest.fixture(scope="session", autouse=True)
def _session_runtime_dir() -> Iterator[Path]:
    """Safety net: even tests that do not ask for ``runtime_dir`` never touch the real per-user dir."""
    path = _private_dir("gs-session-")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUNTIME_DIR_ENV, str(path))
        yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh, empty 0700 directory exported as ``GIGASHUFFLE_RUNTIME_DIR`` for this test only."""
    path = _private_dir("gs-rt-")
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedRedis]:
    """This worker's private Redis (session scope gives one per xdist worker), stopped at session end."""
    server = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: ManagedRedis) -> str:
    """URL of this worker's Redis, emptied (FLUSHALL), and revived if an earlier test paused or killed it."""
    redis_server.ensure_running()
    with redis_server.client() as client:
        client.flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A 3-master cluster for this worker, started on first request only (it takes a few seconds)."""
    with RedisCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_url(redis_cluster: RedisCluster) -> str:
    """URL of a node of this worker's cluster, with every node emptied first."""
    redis_cluster.flushall()
    return redis_cluster.url


@pytest.fixture
def client(redis_url: str) -> Iterator[Any]:
    """A gigashuffle Redis client (its retry policy included) on this worker's emptied Redis."""
    from gigashuffle.control.client import connect

    c = connect(redis_url, total_timeout_s=5.0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def lean() -> Iterator[LeanProcess]:
    """A lean interpreter for the module's fork-heavy bodies (tests/lean.py), stopped after the module's tests."""
    process = LeanProcess()
    try:
        yield process
    finally:
        process.close()
