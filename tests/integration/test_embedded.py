"""The embedded default: with no redis_url and no GIGASHUFFLE_REDIS_URL, the first loader of a node starts a
private server on a unix socket in the runtime dir, later loaders share it, the last one stops it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import leaks
import psutil
import pytest
import redis
from datasets import UniqueIds, check_unique_batch, take, wait_for

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.control.embedded import answers

ENV = "GIGASHUFFLE_REDIS_URL"


def _config(tag: str, **overrides: Any) -> DataloaderConfig:
    settings: dict[str, Any] = dict(
        bs=4, shuffle_size=64, queue_name=f"{tag}-{uuid.uuid4().hex[:8]}", num_writers=1, num_readers=1
    )
    settings.update(overrides)
    return DataloaderConfig(**settings)


def _servers(socket_path: Path, under: psutil.Process | None = None) -> list[psutil.Process]:
    """Live descendants of this process (or of ``under``) serving ``socket_path``: the server, not its keeper."""
    found = []
    for proc in (under or psutil.Process()).children(recursive=True):
        try:
            if (
                proc.status() != psutil.STATUS_ZOMBIE
                and proc.name().endswith("-server")
                and str(socket_path) in " ".join(proc.cmdline())
            ):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


# A loader of its own process on the embedded default: it says "ready" once it has a batch, then closes when told.
_OTHER_PROCESS = """
import sys, uuid
from datasets import UniqueIds
from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
cfg = DataloaderConfig(bs=4, shuffle_size=64, queue_name=f"emb-other-{uuid.uuid4().hex[:8]}", num_writers=1,
                       num_readers=1)
with MultiprocessShuffledDataloader(UniqueIds(base=2 * 10**12), cfg) as loader:
    next(iter(loader))
    print("ready", flush=True)
    sys.stdin.readline()
"""


def _gone(proc: psutil.Process) -> bool:
    """Whether ``proc`` has exited; an orphan this (subreaper) process adopted is reaped."""
    try:
        if proc.status() != psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:
        return True
    with contextlib.suppress(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)
    return True


@contextlib.contextmanager
def _other_processes(n: int) -> Iterator[list[subprocess.Popen[str]]]:
    """``n`` processes with a loader each on the embedded default, each with a batch in hand; killed at the end if
    still running."""
    path = os.pathsep.join([str(Path(__file__).parent), *sys.path])  # datasets.py, and this interpreter's path
    command, env = [sys.executable, "-c", _OTHER_PROCESS], {**os.environ, "PYTHONPATH": path}
    users = [
        subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)
    ]
    try:
        for user in users:
            assert user.stdout is not None and user.stdout.readline().strip() == "ready"
        yield users
    finally:
        for user in users:
            if user.poll() is None:
                user.kill()
                user.wait()


def _wait_stopped(server: psutil.Process, keeper: psutil.Process, socket_path: Path, after: str) -> None:
    wait_for(lambda: _gone(server), f"the embedded server to stop after {after}")
    wait_for(lambda: not socket_path.exists(), "the embedded server's socket to be removed")
    wait_for(lambda: _gone(keeper), "the server's keeper to exit")


@pytest.fixture
def no_env_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


@pytest.mark.usefixtures("no_env_url")
def test_embedded_server_is_started_shared_and_stopped(runtime_dir: Path) -> None:
    socket_path = runtime_dir / "redis-n0.sock"
    assert not socket_path.exists()
    first = MultiprocessShuffledDataloader(UniqueIds(base=0), _config("emb-a"))
    second = None
    try:
        assert first.redis_url == f"unix://{socket_path}"
        assert socket_path.exists() and answers(socket_path)
        assert socket_path.stat().st_mode & 0o077 == 0, "the socket is private to this user"
        servers = _servers(socket_path)
        assert len(servers) == 1
        server_pid = servers[0].pid
        keeper = servers[0].parent()
        assert keeper is not None and keeper.ppid() == os.getpid(), "the first loader's process starts the keeper"

        second = MultiprocessShuffledDataloader(UniqueIds(base=10**12), _config("emb-b"))
        assert second.redis_url == first.redis_url
        assert [p.pid for p in _servers(socket_path)] == [server_pid], "the second loader reuses the server"
        for loader, base in ((first, 0), (second, 10**12)):
            ids = check_unique_batch(take(iter(loader), 1)[0], 4, 64)
            assert all(base <= i < base + 10**12 for i in ids)

        # The loader that started the server closes first: the server stays for the other one.
        first.close()
        assert answers(socket_path)
        assert [p.pid for p in _servers(socket_path)] == [server_pid]
        check_unique_batch(take(iter(second), 1)[0], 4, 64)

        second.close()
        wait_for(lambda: not _servers(socket_path), "the embedded server to exit")
        assert not answers(socket_path)
        wait_for(lambda: not socket_path.exists(), "the embedded server's socket to be removed")
        # Stopped by the second loader's release, the keeper exits; its parent, this process, must reap it.
        wait_for(lambda: not psutil.pid_exists(keeper.pid), "the keeper to be reaped, not left a zombie of its starter")
    finally:
        first.close()
        if second is not None:
            second.close()


@pytest.mark.usefixtures("no_env_url")
def test_the_server_outlives_the_process_that_started_it_while_another_uses_it(runtime_dir: Path) -> None:
    """Ranks of a node are processes: the one that started the node's server may end first. The others keep it
    (once it died with its starter, and they failed after redis_timeout_s); once the last is gone, it stops."""
    socket_path = runtime_dir / "redis-n0.sock"
    with _other_processes(1) as (starter,):
        (server,) = _servers(socket_path, under=psutil.Process(starter.pid))
        keeper = server.parent()
        assert keeper is not None and keeper.pid != starter.pid, "the server's life is not its starter's"
        with MultiprocessShuffledDataloader(UniqueIds(base=0), _config("emb-stay", redis_timeout_s=5.0)) as loader:
            check_unique_batch(take(iter(loader), 1)[0], 4, 64)
            starter.communicate("close\n", timeout=120)
            assert starter.returncode == 0
            assert loader.processes(), "this loader's processes, read from Redis after the starter is gone"
            check_unique_batch(take(iter(loader), 1)[0], 4, 64)
            assert not _gone(server) and answers(socket_path), "the starter's exit took the server along"
        _wait_stopped(server, keeper, socket_path, "its last user closed")


@pytest.mark.usefixtures("no_env_url")
def test_a_server_whose_users_were_all_killed_stops(runtime_dir: Path) -> None:
    """SIGKILLed users release nothing: the keeper sees them gone and stops the server."""
    socket_path = runtime_dir / "redis-n0.sock"
    with _other_processes(2) as users:
        # Either may have started it: they came up together.
        (server,) = [found for user in users for found in _servers(socket_path, under=psutil.Process(user.pid))]
        keeper = server.parent()
        assert keeper is not None
        for user in users:
            user.kill()
            user.wait()
        _wait_stopped(server, keeper, socket_path, "its users were killed")


@pytest.mark.usefixtures("no_env_url")
def test_a_new_server_starts_after_the_last_one_stopped(runtime_dir: Path) -> None:
    socket_path = runtime_dir / "redis-n0.sock"
    with MultiprocessShuffledDataloader(UniqueIds(), _config("emb-1")) as loader:
        take(iter(loader), 1)
    wait_for(lambda: not _servers(socket_path), "the embedded server to exit")
    with MultiprocessShuffledDataloader(UniqueIds(), _config("emb-2")) as loader:
        assert answers(socket_path)
        check_unique_batch(take(iter(loader), 1)[0], 4, 64)


@pytest.mark.usefixtures("no_env_url")
def test_embedded_server_per_node(runtime_dir: Path) -> None:
    """A simulated second node (rank 1, one rank per node) gets its own server socket."""
    cfg = _config("emb-node", global_rank=1, global_world_size=2, local_world_size=1)
    with MultiprocessShuffledDataloader(UniqueIds(), cfg) as loader:
        assert loader.redis_url == f"unix://{runtime_dir / 'redis-n1.sock'}"
        assert not (runtime_dir / "redis-n0.sock").exists()
        check_unique_batch(take(iter(loader), 1)[0], 4, 64)


def test_env_url_is_honoured(redis_url: str, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, redis_url)
    cfg = _config("emb-env")
    with MultiprocessShuffledDataloader(UniqueIds(), cfg) as loader:
        assert loader.redis_url == redis_url
        check_unique_batch(take(iter(loader), 1)[0], 4, 64)
        with redis.Redis.from_url(redis_url) as client:
            assert client.exists(f"gigashuffle:{{{cfg.queue_name}@n0}}:gen")
        assert not list(runtime_dir.glob("redis-*.sock")), "no embedded server with the env URL set"
    # An explicit redis_url wins over the environment.
    monkeypatch.setenv(ENV, "redis://127.0.0.1:1/0")
    explicit = _config("emb-explicit", redis_url=redis_url)
    with MultiprocessShuffledDataloader(UniqueIds(), explicit) as loader:
        assert loader.redis_url == redis_url


def test_a_bad_env_url_is_refused(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "localhost:6379")
    with pytest.raises(ValueError, match=ENV):
        MultiprocessShuffledDataloader(UniqueIds(), _config("emb-bad"))
    assert not list(runtime_dir.glob("redis-*.sock"))


@pytest.mark.usefixtures("no_env_url")
def test_embedded_loader_leaves_nothing_behind(runtime_dir: Path) -> None:
    kw: dict[str, Any] = dict(runtime_dir=runtime_dir, shm_pattern="*gigashuffle*")
    before = leaks.snapshot(**kw)
    loader = MultiprocessShuffledDataloader(UniqueIds(), _config("emb-leak", num_writers=2, num_readers=2))
    socket_path = runtime_dir / "redis-n0.sock"
    check_unique_batch(take(iter(loader), 3)[-1], 4, 64)
    assert _servers(socket_path)
    loader.close()
    loader.close()
    leaks.assert_no_leaks(before, deadline_s=15, **kw)  # no server process, no socket files, no fds
    assert not _servers(socket_path) and not socket_path.exists()


@pytest.mark.usefixtures("no_env_url")
def test_dropped_embedded_loader_stops_its_server(runtime_dir: Path) -> None:
    import gc

    kw: dict[str, Any] = dict(runtime_dir=runtime_dir, shm_pattern="*gigashuffle*")
    before = leaks.snapshot(**kw)
    loader = MultiprocessShuffledDataloader(UniqueIds(), _config("emb-drop"))
    take(iter(loader), 1)
    del loader
    gc.collect()
    leaks.assert_no_leaks(before, deadline_s=15, **kw)
