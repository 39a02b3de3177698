"""The private runtime directory, the node secret, and the HMAC-signed buffer metadata in Redis."""

from __future__ import annotations

import multiprocessing
import os
import pwd
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from gigashuffle import GigashuffleError, TamperedMetadataError
from gigashuffle.control.client import Client
from gigashuffle.control.keys import QueueKeys
from gigashuffle.control.plane import ControlPlane
from gigashuffle.control.signedmeta import signed_meta, verified_layout
from gigashuffle.host import rundir
from gigashuffle.host.pids import pid_alive
from gigashuffle.host.rundir import attach_socket_path, remove_socket, remove_stale_sockets
from gigashuffle.host.secret import node_secret, sign, verify
from gigashuffle.schema import Layout

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
ENV = "GIGASHUFFLE_RUNTIME_DIR"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=10)
    return proc.pid


# -- runtime_dir ----------------------------------------------------------------------------------------------
def test_runtime_dir_uses_the_env_var(runtime_dir: Path) -> None:
    assert rundir.runtime_dir() == runtime_dir
    assert mode(runtime_dir) == 0o700


def test_explicit_dir_is_created_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.umask(old := os.umask(0))  # read the umask without changing it
    target = tmp_path / "a" / "b" / "gigashuffle"
    monkeypatch.setenv(ENV, str(target))
    assert rundir.runtime_dir() == target
    assert mode(target) == 0o700
    assert mode(target.parent) == 0o700 & ~old
    assert os.lstat(target).st_uid == os.getuid()
    assert rundir.runtime_dir() == target  # idempotent


def test_xdg_runtime_dir_is_the_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert rundir.runtime_dir() == xdg / "gigashuffle"
    assert mode(xdg / "gigashuffle") == 0o700


def assert_refused(path: Path, found: str) -> None:
    with pytest.raises(GigashuffleError) as info:
        rundir.runtime_dir()
    message = str(info.value)
    assert f"runtime directory {path} must be a directory owned by uid {os.getuid()} with mode 0700" in message
    assert found in message
    assert "GIGASHUFFLE_RUNTIME_DIR" in message  # the fix


@pytest.mark.parametrize("loose", [0o755, 0o750, 0o701, 0o777])
def test_dir_with_loose_mode_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loose: int) -> None:
    path = tmp_path / "rt"
    path.mkdir()
    os.chmod(path, loose)
    monkeypatch.setenv(ENV, str(path))
    assert_refused(path, f"mode {loose:o}")
    assert mode(path) == loose  # refused, not silently "fixed"


@needs_root
def test_dir_owned_by_another_uid_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rt"
    path.mkdir(mode=0o700)
    nobody = pwd.getpwnam("nobody").pw_uid
    os.chown(path, nobody, -1)
    monkeypatch.setenv(ENV, str(path))
    assert_refused(path, f"found uid {nobody}, mode 700")


def test_symlink_to_a_private_dir_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    monkeypatch.setenv(ENV, str(link))
    assert_refused(link, "mode 777")


def test_regular_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"")
    os.chmod(path, 0o600)
    monkeypatch.setenv(ENV, str(path))
    with pytest.raises(GigashuffleError, match="must be a directory"):
        rundir.runtime_dir()


# -- node secret, signatures ----------------------------------------------------------------------------------
def test_node_secret_is_private_and_stable(runtime_dir: Path) -> None:
    secret = node_secret()
    path = runtime_dir / "secret"
    assert len(secret) == 32
    assert mode(path) == 0o600
    assert os.lstat(path).st_uid == os.getuid()
    assert node_secret() == secret
    assert node_secret(runtime_dir) == secret
    assert path.read_bytes() == secret


def test_node_secrets_differ_between_directories(runtime_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    assert node_secret(other) != node_secret(runtime_dir)


def test_incomplete_node_secret_is_refused(runtime_dir: Path) -> None:
    path = runtime_dir / "secret"
    path.write_bytes(b"short")
    with pytest.raises(GigashuffleError, match=rf"node secret {path} is incomplete \(5 of 32 bytes\); remove it"):
        node_secret()


def test_sign_and_verify() -> None:
    secret = b"k" * 32
    signature = sign(secret, b"gen", b"layout")
    assert verify(secret, signature, b"gen", b"layout")
    assert verify(secret, signature.encode(), b"gen", b"layout")  # as redis-py returns it
    assert not verify(secret, signature, b"gen", b"layouT")
    assert not verify(b"x" * 32, signature, b"gen", b"layout")
    # Parts are length-prefixed: moving a boundary changes the signature.
    assert sign(secret, b"ab", b"c") != sign(secret, b"a", b"bc")
    assert sign(secret, b"abc") != sign(secret, b"abc", b"")


# -- process and socket housekeeping --------------------------------------------------------------------------
def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    assert pid_alive(1)
    assert not pid_alive(dead_pid())


def test_remove_stale_sockets_keeps_live_ones(runtime_dir: Path) -> None:
    dead, live = dead_pid(), os.getpid()
    # A child's socket names its pid; a trainer's its pid and a part of its own (NOTE [ The trainer holds the buffer ]).
    names = (f"attach-{dead}.sock", f"attach-{dead}-t1a2b.sock", f"attach-{live}.sock", f"attach-{live}-t3c4d.sock")
    for name in (*names, "attach-x.sock", "secret-keep"):
        (runtime_dir / name).write_bytes(b"")
    assert attach_socket_path(dead) == runtime_dir / f"attach-{dead}.sock"
    assert sorted(remove_stale_sockets()) == sorted(runtime_dir / name for name in names[:2])
    assert sorted(p.name for p in runtime_dir.iterdir()) == sorted([*names[2:], "attach-x.sock", "secret-keep"])


def test_remove_socket(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    remove_socket(path)  # missing is fine
    path.write_bytes(b"")
    remove_socket(path)
    assert not path.exists()
    path.mkdir()
    with pytest.raises(OSError):
        remove_socket(path)  # anything but "missing" is an error


# -- signed metadata ------------------------------------------------------------------------------------------
QUEUE = "meta-q"
GEN = "gen-meta"
LAYOUT = Layout.from_chunk([{"x": torch.zeros(2, 3)}, {"y": torch.zeros(2, dtype=torch.int64)}])


def fields(layout: Layout = LAYOUT) -> dict[str, bytes]:
    return {
        "layout": layout.to_json().encode(),
        "slots": b"64",
        "first_row": bytes(range(20)),
        "owner": b"w0",
        "nbytes": b"4096",
    }


@pytest.fixture
def published(client: Client) -> tuple[ControlPlane, bytes]:
    """Metadata published the way writers do it (seed), read back from Redis as bytes."""
    secret = os.urandom(32)
    keys = QueueKeys(QUEUE, "n0")
    client.set(keys.gen, GEN)
    store = ControlPlane(client, keys, generation=GEN)
    assert store.publish_meta(signed_meta(secret, GEN, fields()))
    return store, secret


def test_intact_metadata_is_accepted(published: tuple[ControlPlane, bytes]) -> None:
    store, secret = published
    meta = store.meta()
    assert set(meta) == {"layout", "slots", "first_row", "owner", "nbytes", "hmac"}
    assert meta["first_row"] == bytes(range(20))
    assert verified_layout(secret, GEN, meta, QUEUE) == LAYOUT


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("layout", Layout.from_chunk([{"x": torch.zeros(2, 4)}, {"y": torch.zeros(2, dtype=torch.int64)}]).to_json()),
        ("first_row", bytes(range(1, 21))),
        ("slots", "128"),
        ("owner", "w1"),
        ("nbytes", "8192"),
    ],
)
def test_modified_field_is_refused(
    published: tuple[ControlPlane, bytes], client: Client, field: str, value: str | bytes
) -> None:
    store, secret = published
    client.hset(store.keys.meta, field, value)  # another user with access to Redis rewrites a field
    with pytest.raises(TamperedMetadataError) as info:
        verified_layout(secret, GEN, store.meta(), QUEUE)
    assert f"queue {QUEUE!r}" in str(info.value)
    assert "fails its HMAC check" in str(info.value)


@pytest.mark.parametrize("field", ["hmac", "layout", "first_row"])
def test_missing_field_is_refused_and_named(published: tuple[ControlPlane, bytes], client: Client, field: str) -> None:
    store, secret = published
    client.hdel(store.keys.meta, field)
    with pytest.raises(TamperedMetadataError, match=f"missing {field}"):
        verified_layout(secret, GEN, store.meta(), QUEUE)


def test_metadata_of_another_generation_is_refused(published: tuple[ControlPlane, bytes]) -> None:
    store, secret = published
    with pytest.raises(TamperedMetadataError):
        verified_layout(secret, "gen-later", store.meta(), QUEUE)


def test_metadata_signed_with_another_secret_is_refused(published: tuple[ControlPlane, bytes]) -> None:
    store, _secret = published
    with pytest.raises(TamperedMetadataError, match="not written by a gigashuffle process of this user"):
        verified_layout(os.urandom(32), GEN, store.meta(), QUEUE)


def test_re_signed_forgery_needs_the_secret(published: tuple[ControlPlane, bytes], client: Client) -> None:
    # A forger can replace the whole hash, hmac included, but cannot sign without the node secret.
    store, secret = published
    forged = signed_meta(b"\x00" * 32, GEN, fields(Layout.from_chunk([{"x": torch.zeros(2, 9)}])))
    client.delete(store.keys.meta)
    client.hset(store.keys.meta, mapping=forged)
    with pytest.raises(TamperedMetadataError):
        verified_layout(secret, GEN, store.meta(), QUEUE)


def _race_for_secret(directory: str, barrier: Any, results: Any) -> None:
    os.environ[ENV] = directory
    barrier.wait(timeout=30)
    try:
        results.put(("ok", rundir.runtime_dir() == Path(directory), node_secret()))
    except BaseException as exc:  # the parent asserts on what went wrong, with its text
        results.put(("error", False, repr(exc).encode()))


def test_processes_racing_on_a_fresh_dir_all_get_the_same_complete_secret(tmp_path: Path) -> None:
    """Every rank and child of a node starts at once: the first-creates-the-file paths must not tear."""
    ctx = multiprocessing.get_context("fork")
    racers, rounds = 8, 25
    for round_no in range(rounds):
        directory = tmp_path / f"round-{round_no}" / "gigashuffle"  # neither level exists yet
        barrier, results = ctx.Barrier(racers), ctx.Queue()
        procs = [ctx.Process(target=_race_for_secret, args=(str(directory), barrier, results)) for _ in range(racers)]
        for proc in procs:
            proc.start()
        got = [results.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(timeout=60)
            assert proc.exitcode == 0, f"round {round_no}: racer exited with {proc.exitcode}"
        assert all(kind == "ok" and same_dir for kind, same_dir, _ in got), f"round {round_no}: {got}"
        secrets = {secret for _, _, secret in got}
        assert len(secrets) == 1, f"round {round_no}: {len(secrets)} different secrets"
        assert len(secrets.pop()) == 32
        assert sorted(p.name for p in directory.iterdir()) == ["secret"], "a candidate file was left behind"
        assert mode(directory) == 0o700
