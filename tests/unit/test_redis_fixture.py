"""The test infrastructure itself: real servers, the cluster, runtime-dir isolation and leak accounting.

If these fail, every test that relies on them would fail in confusing ways, so they fail first and plainly.
"""

from __future__ import annotations

import _multiprocessing
import contextlib
import mmap
import os
import signal
import socket
import stat
import subprocess
import sys
import uuid
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import leaks
import psutil
import pytest
import redis
import redis_servers
from redis_servers import RedisCluster, RedisServer, wait_until


def test_find_server_binary_runs() -> None:
    out = subprocess.run(
        [redis_servers.find_server_binary(), "--version"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert out.returncode == 0
    assert "v=" in out.stdout


def test_docker_probe_answers_a_bool() -> None:
    assert isinstance(redis_servers.docker_engine_available(timeout_s=1.0), bool)


def test_server_answers_on_tcp_and_unix(redis_server: redis_servers.ManagedRedis, redis_url: str) -> None:
    assert redis_url == redis_server.url
    assert redis_url.startswith("redis://")
    with redis.Redis.from_url(redis_url) as tcp:
        assert tcp.ping()
        tcp.set("seen-by", "tcp")
    if redis_server.unix_url is None:
        pytest.skip("container servers have no unix socket")
    assert redis_server.unix_url.startswith("unix://")
    sock = Path(redis_server.unix_url.removeprefix("unix://"))
    assert stat.S_IMODE(sock.stat().st_mode) == 0o700
    with redis.Redis.from_url(redis_server.unix_url) as unix:
        assert unix.get("seen-by") == b"tcp"


@pytest.mark.parametrize("round_", [1, 2])
def test_redis_url_starts_empty(redis_url: str, round_: int) -> None:
    with redis.Redis.from_url(redis_url) as client:
        assert client.dbsize() == 0
        client.set(f"left-behind-{round_}", 1)  # the next test on this worker must not see it


def test_restart_keeps_addresses_and_empties_data(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as server:
        port, unix_url, old_pid = server.port, server.unix_url, server.pid
        with server.client() as client:
            client.set("k", "v")
        server.restart()
        assert (server.port, server.unix_url) == (port, unix_url)
        assert server.pid != old_pid
        with server.client() as client:
            assert client.dbsize() == 0
        with redis.Redis.from_url(server.unix_url) as unix:
            assert unix.ping()


def test_kill_then_ensure_running(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as server, server.client(socket_timeout=2) as client:
        server.kill()
        assert not server.is_running()
        with pytest.raises(redis.ConnectionError):
            client.ping()
        server.ensure_running()
        assert client.ping()  # redis-py reconnects on the next command


def test_pause_blocks_and_resume_recovers(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as server, server.client(socket_timeout=0.3) as client:
        client.set("k", "v")
        server.pause()
        with pytest.raises(redis.TimeoutError):
            client.get("k")
        server.resume()
        assert client.get("k") == b"v"  # a pause is not a restart: data survives


def test_stop_is_idempotent_and_cleans_up(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    pid, directory = server.pid, server.directory
    server.stop()
    server.stop()
    assert not directory.exists()
    assert pid not in redis_servers.managed_pids()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_cluster_spreads_keys_and_runs_hash_tagged_lua(redis_cluster_url: str, redis_cluster: RedisCluster) -> None:
    assert redis_cluster_url == redis_cluster.url
    assert len(set(redis_cluster.ports)) == 3
    with redis_cluster.client() as client:
        owners: dict[int, str] = {}
        for i in range(200):
            key = f"spread:{i}"
            owners.setdefault(client.get_node_from_key(key).port, key)
            if len(owners) == 3:
                break
        assert sorted(owners) == sorted(redis_cluster.ports)
        for port, key in owners.items():
            client.set(key, port)
        for port, key in owners.items():
            assert client.get(key) == str(port).encode()

        script = "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('INCRBY', KEYS[2], ARGV[2])"
        assert client.eval(script, 2, "{q}:head", "{q}:count", "x", 5) == 5
        assert client.eval(script, 2, "{q}:head", "{q}:count", "y", 5) == 10
        assert client.get("{q}:head") == b"y"
        # Proof that the servers themselves enforce cluster rules: a node redirects keys it does not own.
        first, second = redis_cluster.nodes[0], redis_cluster.ports[1]
        with first.client() as plain, pytest.raises(redis.exceptions.MovedError):
            plain.get(owners[second])

        # Leak accounting's SCAN must see keys on every shard, not just the node it first talks to.
        snap = leaks.snapshot(redis_client=client, key_pattern="spread:*")
        assert snap.redis_keys == set(owners.values())


def test_runtime_dir_is_private_and_exported(runtime_dir: Path, _session_runtime_dir: Path) -> None:
    assert os.environ["GIGASHUFFLE_RUNTIME_DIR"] == str(runtime_dir)
    assert runtime_dir != _session_runtime_dir
    assert stat.S_IMODE(runtime_dir.stat().st_mode) == 0o700
    assert list(runtime_dir.iterdir()) == []


def test_runtime_dir_is_set_even_without_the_fixture(_session_runtime_dir: Path) -> None:
    assert os.environ["GIGASHUFFLE_RUNTIME_DIR"] == str(_session_runtime_dir)


def test_leak_accounting_detects_then_clears(runtime_dir: Path, redis_url: str) -> None:
    tag = f"gs-leaktest-{uuid.uuid4().hex[:12]}"
    args: dict[str, Any] = {"key_pattern": f"{tag}:*", "runtime_dir": runtime_dir, "shm_pattern": f"{tag}*"}
    with redis.Redis.from_url(redis_url) as client:
        before = leaks.snapshot(redis_client=client, **args)
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            # One deliberate leak of each kind, each with its cleanup registered at once so that a failing
            # assertion below does not leak for real into the rest of the session.
            with contextlib.ExitStack() as cleanup:
                assert child.stdin is not None
                # The child exits on EOF; it is not waited for, so the grace period has to cover its exit.
                cleanup.callback(child.stdin.close)
                fd = os.open(os.devnull, os.O_RDONLY)
                cleanup.callback(os.close, fd)
                sock_path = runtime_dir / "leaked.sock"
                with socket.socket(socket.AF_UNIX) as listener:
                    listener.bind(str(sock_path))  # closing the socket leaves the file: that is the leak
                cleanup.callback(sock_path.unlink)
                client.set(f"{tag}:slot", 1)
                cleanup.callback(client.delete, f"{tag}:slot")
                segment = shared_memory.SharedMemory(name=f"{tag}-shm", create=True, size=4096)
                cleanup.callback(segment.unlink)
                cleanup.callback(segment.close)
                sem_name = f"/{tag}-sem"
                # A named POSIX semaphore that is kept (not unlinked at once as multiprocessing does).
                _multiprocessing.SemLock(1, 1, 1, sem_name, False)
                cleanup.callback(_multiprocessing.sem_unlink, sem_name)

                found = leaks.diff(before, leaks.snapshot(redis_client=client, **args))
                assert (fd, os.path.realpath(os.devnull)) in found["fds"]
                assert [c.pid for c in found["children"]] == [child.pid]
                assert found["sockets"] == [str(sock_path)]
                assert found["redis_keys"] == [f"{tag}:slot"]
                assert found["shm"] == [f"{tag}-shm"]
                assert found["semaphores"] == [f"sem.{tag}-sem"]
                with pytest.raises(AssertionError, match=r"(?s)children \(1\).*leaked\.sock"):
                    leaks.assert_no_leaks(before, deadline_s=0.2, redis_client=client, **args)

            child.wait(timeout=10)  # it exits on EOF; until it is reaped it is a zombie of ours, which counts
            leaks.assert_no_leaks(before, deadline_s=10.0, redis_client=client, **args)
        finally:
            child.kill()
            child.wait(timeout=10)


def test_leak_accounting_sees_memfd_mappings_zombies_and_orphans(runtime_dir: Path) -> None:
    before = leaks.snapshot(runtime_dir=runtime_dir)
    # A mapping of a gigashuffle memfd whose fd is closed: no fd, no /dev/shm name, only the mapping is left.
    fd = os.memfd_create("gigashuffle-leaktest", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    mapping = mmap.mmap(fd, 4096)
    os.close(fd)
    found = leaks.diff(before, leaks.snapshot(runtime_dir=runtime_dir))
    assert len(found.get("mappings", [])) == 1 and "memfd:gigashuffle-leaktest" in found["mappings"][0], found
    mapping.close()
    leaks.assert_no_leaks(before, deadline_s=5.0, runtime_dir=runtime_dir)

    # A child that exited but was never waited for: a zombie, counted until reaped.
    exited = subprocess.Popen(["true"])
    wait_until(lambda: psutil.Process(exited.pid).status() == psutil.STATUS_ZOMBIE, timeout_s=10, what="a zombie")
    found = leaks.diff(before, leaks.snapshot(runtime_dir=runtime_dir))
    assert [c.pid for c in found.get("children", [])] == [exited.pid], found
    exited.wait(timeout=10)
    leaks.assert_no_leaks(before, deadline_s=5.0, runtime_dir=runtime_dir)

    # A grandchild whose parent exited first: the test process (a subreaper) adopts it, so it still counts.
    spawn = "import subprocess as s; print(s.Popen(['sleep', '60'], stdout=s.DEVNULL, stderr=s.DEVNULL).pid)"
    spawner = subprocess.run([sys.executable, "-c", spawn], capture_output=True, text=True, timeout=60, check=True)
    orphan = int(spawner.stdout)
    try:
        assert psutil.Process(orphan).ppid() == os.getpid(), "the orphan was not adopted by the test process"
        found = leaks.diff(before, leaks.snapshot(runtime_dir=runtime_dir))
        assert [c.pid for c in found.get("children", [])] == [orphan], found
    finally:
        os.kill(orphan, signal.SIGKILL)
    # Once dead, the adopted orphan is reaped by the snapshot itself: nothing of it is left.
    leaks.assert_no_leaks(before, deadline_s=10.0, runtime_dir=runtime_dir)


def test_leak_accounting_ignores_fixture_server_restarts(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as server:
        before = leaks.snapshot(shm_pattern="gs-none-*")
        server.restart()  # a new server child, but one the fixtures own
        leaks.assert_no_leaks(before, deadline_s=5.0, shm_pattern="gs-none-*")


def test_wait_until_times_out_with_the_reason() -> None:
    with pytest.raises(TimeoutError, match="the impossible"):
        wait_until(lambda: False, timeout_s=0.1, what="the impossible")
