"""The attach socket (NOTE [ Attach ] in procs/attach.py): same-uid processes get the memfd, other uids get nothing."""

from __future__ import annotations

import json
import logging
import os
import pwd
import select
import socket
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gigashuffle import AttachError
from gigashuffle.host import rundir
from gigashuffle.host.rundir import attach_socket_path
from gigashuffle.procs import attach as attach_module
from gigashuffle.procs.attach import AttachServer, attach, peer_uid
from gigashuffle.shm.buffer import SharedMemory

INFO = {"layout": '{"num_groups":1,"fields":[[0,"x","uint8",[4]]]}', "slots": 1024, "owner": "w0"}
SUBPROCESS_TIMEOUT_S = 30
NOBODY = "nobody"
NOGROUP = "nogroup"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running a process as another uid needs root (setpriv)")

# A plain-stdlib attach client for another uid: it cannot import gigashuffle from a root-only virtualenv, and
# only needs to report what the server gave it.
FOREIGN_CLIENT = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(10)
try:
    sock.connect(sys.argv[1])
except OSError as exc:
    print(json.dumps({"connected": False, "error": type(exc).__name__}))
    sys.exit(0)
msg, ancillary, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
fds = sum(len(data) // 4 for level, kind, data in ancillary if kind == socket.SCM_RIGHTS)
print(json.dumps({"connected": True, "bytes": len(msg), "fds": fds}))
"""

# A server run by another uid, speaking the attach protocol (header <QB, then the payload, one fd).
FOREIGN_SERVER = """
import array, os, socket, struct, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.bind(sys.argv[1])
sock.listen(1)
sock.settimeout(20)
print("listening", flush=True)
conn, _ = sock.accept()
fd = os.open("/dev/null", os.O_RDONLY)
try:
    conn.sendmsg([struct.pack("<QB", 2, 1)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    conn.sendall(b"{}")
except OSError:
    pass
"""


def as_nobody(script: str, *args: str) -> subprocess.Popen[str]:
    command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOGROUP}", "--clear-groups"]
    return subprocess.Popen(
        [*command, "/usr/bin/python3", "-I", "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
    )


def nobody_uid() -> int:
    return pwd.getpwnam(NOBODY).pw_uid


def run_as_nobody(script: str, *args: str) -> dict[str, object]:
    proc = as_nobody(script, *args)
    out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, err
    result: dict[str, object] = json.loads(out)
    return result


@pytest.fixture
def memory() -> Iterator[SharedMemory]:
    mem = SharedMemory(4096, name="gigashuffle-attach-test")
    mem.view(0, 4096).copy_(torch.arange(4096).remainder(253).to(torch.uint8))
    yield mem
    mem.close()


@pytest.fixture
def server(runtime_dir: Path, memory: SharedMemory) -> Iterator[AttachServer]:
    assert memory.fd is not None
    srv = AttachServer(attach_socket_path(os.getpid(), runtime_dir), (memory.fd,), INFO)
    yield srv
    srv.close()


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def test_same_uid_attach_gets_the_fd_and_payload(server: AttachServer, memory: SharedMemory) -> None:
    info, fds = attach(server.path, timeout_s=5.0)
    try:
        assert info == INFO
        assert len(fds) == 1
        assert fds[0] != memory.fd
        assert os.readlink(f"/proc/self/fd/{fds[0]}").startswith("/memfd:gigashuffle-attach-test")
        mapped = SharedMemory(4096, fd=os.dup(fds[0]))
        try:
            assert bytes(mapped.numpy_view(0, 4096)) == bytes(memory.numpy_view(0, 4096))
            mapped.view(100, 4).fill_(0xEE)  # the same pages, not a copy
            assert bytes(memory.numpy_view(100, 4)) == b"\xee" * 4
        finally:
            mapped.close()
    finally:
        close_all(fds)


def test_every_client_is_served(server: AttachServer) -> None:
    inodes = set()
    for _ in range(3):
        info, fds = attach(server.path, timeout_s=5.0)
        assert info == INFO
        inodes.add(os.fstat(fds[0]).st_ino)
        close_all(fds)
    assert len(inodes) == 1


def test_several_fds_travel_together(runtime_dir: Path) -> None:
    first, second = SharedMemory(64), SharedMemory(128)
    assert first.fd is not None
    assert second.fd is not None
    srv = AttachServer(runtime_dir / "attach-multi.sock", (first.fd, second.fd), {"n": 2})
    try:
        info, fds = attach(srv.path, timeout_s=5.0)
        assert info == {"n": 2}
        assert [os.fstat(fd).st_size for fd in fds] == [64, 128]
        close_all(fds)
    finally:
        srv.close()
        first.close()
        second.close()


def test_socket_is_private(server: AttachServer, runtime_dir: Path) -> None:
    assert server.path.parent == runtime_dir
    info = os.lstat(server.path)
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.getuid()
    parent = os.lstat(runtime_dir)
    assert stat.S_IMODE(parent.st_mode) == 0o700
    assert parent.st_uid == os.getuid()
    assert rundir.runtime_dir() == runtime_dir  # the directory the package itself uses


def test_close_removes_the_socket_and_is_idempotent(server: AttachServer) -> None:
    assert server.path.exists()
    server.close()
    assert not server.path.exists()
    assert not server._thread.is_alive()
    server.close()
    with pytest.raises(AttachError, match=str(server.path)):
        attach(server.path, timeout_s=1.0)


def test_close_does_not_wait_for_the_accept_loops_poll(
    runtime_dir: Path, memory: SharedMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() wakes the accept loop: with a poll of an hour it still returns (a loader's close waited up to the
    poll, 0.25 s, here)."""
    monkeypatch.setattr(attach_module, "_ACCEPT_POLL_S", 3600.0)
    assert memory.fd is not None
    srv = AttachServer(runtime_dir / "attach-poll.sock", (memory.fd,), INFO)
    closer = threading.Thread(target=srv.close, name="closer", daemon=True)
    closer.start()
    closer.join(SUBPROCESS_TIMEOUT_S)
    assert not closer.is_alive(), "close() waited for the accept loop's poll"
    assert not srv._thread.is_alive()


def test_stale_socket_file_is_replaced(runtime_dir: Path, memory: SharedMemory) -> None:
    path = runtime_dir / "attach-999999.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a killed process's socket: the file stays, nobody listens
    stale.close()
    assert memory.fd is not None
    srv = AttachServer(path, (memory.fd,), INFO)
    try:
        info, fds = attach(path, timeout_s=5.0)
        assert info == INFO
        close_all(fds)
    finally:
        srv.close()


def test_attach_to_a_missing_socket_names_it(runtime_dir: Path) -> None:
    path = runtime_dir / "attach-1.sock"
    with pytest.raises(AttachError, match=f"could not attach through {path}"):
        attach(path, timeout_s=1.0)


def test_server_without_fds_is_an_attach_error(runtime_dir: Path) -> None:
    srv = AttachServer(runtime_dir / "attach-nofd.sock", (), INFO)
    try:
        with pytest.raises(AttachError, match="sent no file descriptor"):
            attach(srv.path, timeout_s=5.0)
    finally:
        srv.close()


def test_silent_server_times_out(runtime_dir: Path) -> None:
    path = runtime_dir / "attach-silent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)  # connections queue in the backlog; nothing is ever sent
    try:
        with pytest.raises(AttachError, match="timed out"):
            attach(path, timeout_s=0.3)
    finally:
        listener.close()


def test_peer_uid_of_a_socketpair_is_ours() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert peer_uid(a) == os.getuid()


@needs_root
def test_other_uid_cannot_reach_the_socket(server: AttachServer) -> None:
    # The private runtime directory stops another uid before it can even connect.
    result = run_as_nobody(FOREIGN_CLIENT, str(server.path))
    assert result == {"connected": False, "error": "PermissionError"}
    info, fds = attach(server.path, timeout_s=5.0)  # the server is unharmed
    assert info == INFO
    close_all(fds)


@needs_root
def test_other_uid_is_refused_by_peer_credentials(
    server: AttachServer, runtime_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Open the directory and the socket so that the connect succeeds: only SO_PEERCRED stands in the way.
    os.chmod(runtime_dir, 0o711)
    os.chmod(server.path, 0o666)
    try:
        with caplog.at_level(logging.WARNING, logger="gigashuffle.procs.attach"):
            result = run_as_nobody(FOREIGN_CLIENT, str(server.path))
    finally:
        os.chmod(server.path, 0o600)
        os.chmod(runtime_dir, 0o700)
    assert result == {"connected": True, "bytes": 0, "fds": 0}  # EOF, and no fd
    assert f"refused an attach from uid {nobody_uid()}" in caplog.text
    info, fds = attach(server.path, timeout_s=5.0)  # the same uid is still served
    assert info == INFO
    close_all(fds)


@needs_root
def test_client_refuses_a_server_of_another_uid() -> None:
    directory = Path(tempfile.mkdtemp(prefix="gs-foreign-"))
    path = directory / "attach-foreign.sock"
    os.chown(directory, nobody_uid(), -1)
    proc = as_nobody(FOREIGN_SERVER, str(path))
    try:
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], SUBPROCESS_TIMEOUT_S)  # listening, not just bound
        assert readable, f"the server as {NOBODY} did not start within {SUBPROCESS_TIMEOUT_S} s"
        assert proc.stdout.readline() == "listening\n", proc.communicate()[1]
        with pytest.raises(AttachError, match="belongs to uid"):
            attach(path, timeout_s=5.0)
    finally:
        proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        path.unlink(missing_ok=True)
        directory.rmdir()
