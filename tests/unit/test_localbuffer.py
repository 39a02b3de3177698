"""Finding the node buffer through the runtime directory (NOTE [ A buffer Redis forgot ], procs/forgottenbuffer.py)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import leaks
import pytest

from gigashuffle.host.pids import process_start
from gigashuffle.host.rundir import attach_socket_path
from gigashuffle.procs.attach import AttachServer
from gigashuffle.procs.forgottenbuffer import attach_info, buffer_scope, find_served_buffer
from gigashuffle.shm.buffer import SharedMemory

FIELDS = {"layout": b'{"num_groups":1,"fields":[[0,"x","uint8",[4]]]}', "slots": b"16", "first_row": b"\x00\xff"}


@pytest.fixture
def served(runtime_dir: Path) -> Iterator[dict[str, tuple[SharedMemory, SharedMemory]]]:
    """Two processes' worth of attach servers in the runtime dir, for two scopes (of two queues)."""
    memories: dict[str, tuple[SharedMemory, SharedMemory]] = {}
    servers = []
    for fake_pid, queue in ((1_000_001, "q1"), (1_000_002, "q2")):
        scope = buffer_scope("redis://h:6379/0", queue, "node-a")
        buffer, table = SharedMemory(4096), SharedMemory(4096)
        memories[scope] = (buffer, table)
        assert buffer.fd is not None and table.fd is not None
        info = attach_info(scope, 4096, {**FIELDS, "owner": queue.encode()})
        servers.append(AttachServer(attach_socket_path(fake_pid, runtime_dir), (buffer.fd, table.fd), info))
    yield memories
    for server in servers:
        server.close()
    for buffer, table in memories.values():
        buffer.close()
        table.close()


def test_the_scope_names_the_redis_queue_and_node() -> None:
    scope = buffer_scope("redis://h:6379/0", "q", "n")
    assert scope == buffer_scope("redis://h:6379/0", "q", "n")
    others = {buffer_scope("redis://h:6379/1", "q", "n"), buffer_scope("redis://h:6379/0", "q2", "n"),
              buffer_scope("redis://h:6379/0", "q", "n2"), buffer_scope("redis://h:6379/0", "q\0n", "")}  # fmt: skip
    assert scope not in others and len(others) == 4


def test_finds_the_buffer_of_its_scope_among_other_queues_and_stale_sockets(
    runtime_dir: Path, served: dict[str, tuple[SharedMemory, SharedMemory]]
) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a dead process's socket file: nobody listens
    stale.bind(str(attach_socket_path(1_000_000, runtime_dir)))
    stale.close()
    before = leaks.memfd_fds()
    for queue in ("q1", "q2"):
        scope = buffer_scope("redis://h:6379/0", queue, "node-a")
        buffer, table = served[scope]
        found = find_served_buffer(runtime_dir, scope)
        assert found is not None
        assert found.fields == {**FIELDS, "owner": queue.encode()}, "the metadata of that queue's buffer"
        assert buffer.fd is not None and table.fd is not None
        for got, want in ((found.buffer_fd, buffer.fd), (found.table_fd, table.fd)):
            assert os.fstat(got).st_ino == os.fstat(want).st_ino, "the fds name the served memory"
            os.close(got)
    assert find_served_buffer(runtime_dir, buffer_scope("redis://h:6379/0", "q3", "node-a")) is None
    assert leaks.memfd_fds() == before, "every fd of a server of another scope was closed"


def test_an_empty_runtime_dir_has_no_buffer(runtime_dir: Path) -> None:
    assert find_served_buffer(runtime_dir, buffer_scope("redis://h:6379/0", "q", "n")) is None


@contextlib.contextmanager
def _serving(runtime_dir: Path, fake_pid: int, info: dict[str, Any]) -> Iterator[AttachServer]:
    """One process's attach server of a buffer and its table."""
    buffer, table = SharedMemory(4096), SharedMemory(4096)
    assert buffer.fd is not None and table.fd is not None
    server = AttachServer(attach_socket_path(fake_pid, runtime_dir), (buffer.fd, table.fd), info)
    try:
        yield server
    finally:
        server.close()
        buffer.close()
        table.close()


def _found_fields(runtime_dir: Path, scope: str) -> dict[str, bytes] | None:
    """The metadata of the buffer of ``scope`` found, its fds closed; None if none is found."""
    found = find_served_buffer(runtime_dir, scope)
    if found is None:
        return None
    os.close(found.buffer_fd)
    os.close(found.table_fd)
    return found.fields


def test_a_buffer_is_found_only_once_it_says_its_scope(runtime_dir: Path) -> None:
    """A writer serves its new buffer before its publication is decided, without the scope; a losing buffer is
    dropped, so only a won one may be found (NOTE [ A buffer Redis forgot ])."""
    scope = buffer_scope("redis://h:6379/0", "q", "node-a")
    with _serving(runtime_dir, 1_000_003, attach_info(None, 4096, FIELDS)) as server:
        assert _found_fields(runtime_dir, scope) is None
        server.set_info(attach_info(scope, 4096, FIELDS))
        assert _found_fields(runtime_dir, scope) == FIELDS


def test_a_buffer_whose_trainer_is_gone_is_not_adopted(runtime_dir: Path) -> None:
    """A previous run's children serve its buffer for a moment after their trainer died (until the zygote notices):
    a new run (a resume) must not adopt it. The reply names the trainer; a dead one's buffer is passed over."""
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    dead = (gone, process_start(gone))  # a zombie still has its start time
    os.waitpid(gone, 0)
    assert dead[1] != 0 and process_start(gone) != dead[1], "the trainer named is dead"
    scope = buffer_scope("redis://h:6379/0", "q", "node-a")
    with _serving(runtime_dir, 1_000_004, attach_info(scope, 4096, FIELDS, dead)) as server:
        before = leaks.memfd_fds()
        assert _found_fields(runtime_dir, scope) is None
        assert leaks.memfd_fds() == before, "the passed-over buffer's fds were closed"
        server.set_info(attach_info(scope, 4096, FIELDS, (os.getpid(), process_start(os.getpid()))))
        assert _found_fields(runtime_dir, scope) == FIELDS, "a live trainer's buffer is found"
