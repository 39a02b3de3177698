"""A writer that finds no buffer in Redis adopts the node's live one (NOTE [ A buffer Redis forgot ]).

Several children's environments in this one process, on a real Redis, as separate processes would have them
(each its own attach socket); the flush stands for a Redis that forgot the session.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import leaks
import pytest
import torch

from gigashuffle import DataloaderConfig
from gigashuffle.control.client import connect
from gigashuffle.control.session import NodeSession
from gigashuffle.control.signedmeta import verified_layout
from gigashuffle.procs import childenv
from gigashuffle.procs.channel import Channel
from gigashuffle.procs.childspec import ChildSpec
from gigashuffle.procs.forgottenbuffer import ServedBuffer, find_served_buffer
from gigashuffle.schema import Layout

QUEUE = "adopt"


class Children:
    """Builds child environments and closes everything they opened."""

    def __init__(self, redis_url: str, runtime_dir: Path) -> None:
        self.redis_url, self.runtime_dir = redis_url, runtime_dir
        self.envs: list[childenv.ChildEnv] = []
        self.ends: list[Channel] = []

    def env(self, config: DataloaderConfig, generation: str) -> childenv.ChildEnv:
        ours, theirs = Channel.pair()
        self.ends += [ours, theirs]
        spec = ChildSpec(role="writer", index=len(self.envs), config=config, redis_url=self.redis_url,
                         generation=generation, runtime_dir=str(self.runtime_dir))  # fmt: skip
        env = childenv.ChildEnv(spec, theirs)
        self.envs.append(env)
        return env

    def close(self) -> None:
        for env in self.envs:
            env.close()
        for end in self.ends:
            end.close()


@pytest.fixture
def children(redis_url: str, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Children]:
    numbers = itertools.count()  # every env here shares this pid: each gets its own socket, as a process would
    monkeypatch.setattr(childenv, "attach_socket_path", lambda pid, d: d / f"attach-{pid}-{next(numbers)}.sock")
    made = Children(redis_url, runtime_dir)
    yield made
    made.close()


def _config(redis_url: str, shuffle_size: int = 16) -> DataloaderConfig:
    return DataloaderConfig(bs=4, shuffle_size=shuffle_size, queue_name=QUEUE, redis_url=redis_url)


def _inode(fd: int | None) -> int:
    assert fd is not None
    return os.fstat(fd).st_ino


LAYOUT = Layout.from_chunk([{"x": torch.arange(8, dtype=torch.int64)}])


@dataclass
class Forgotten:
    """A node whose buffer Redis forgot: ``owner`` published it under one session, then Redis was flushed and
    ``generation`` is the session joined after that."""

    config: DataloaderConfig
    owner: childenv.ChildEnv
    generation: str


@pytest.fixture
def forgotten(children: Children, redis_url: str) -> Iterator[Forgotten]:
    client = connect(redis_url)
    config = _config(redis_url)
    first = NodeSession(client, config)
    owner = children.env(config, first.generation)
    assert owner.publish_buffer(LAYOUT, b"\x00" * 8)
    assert owner.buffer is not None and owner.table is not None
    client.flushall()  # Redis forgets the session; the buffer lives on in its holders
    second = NodeSession(client, config)
    try:
        yield Forgotten(config, owner, second.generation)
    finally:
        first.leave()  # its claim went with the flush: this only stops its heartbeat
        second.leave()
        client.close()


def test_a_writer_adopts_the_live_buffer_redis_forgot(children: Children, forgotten: Forgotten) -> None:
    owner = forgotten.owner
    assert owner.buffer is not None and owner.table is not None
    adopter = children.env(forgotten.config, forgotten.generation)
    served = find_served_buffer(children.runtime_dir, adopter.scope)
    assert served is not None, "the owner's published buffer is found in the runtime directory"
    assert adopter.adopt_buffer(served) is True
    assert adopter.buffer is not None and adopter.table is not None and adopter.server is not None
    assert _inode(adopter.buffer.memory.fd) == _inode(owner.buffer.memory.fd), "the same buffer, not a new one"
    assert _inode(adopter.table.fd) == _inode(owner.table.fd)
    meta = adopter.store.meta()
    assert verified_layout(adopter.secret, forgotten.generation, meta, QUEUE) == LAYOUT, "signed under the new session"
    assert meta["owner"] == owner.proc.encode(), "the metadata still names the process that allocated it"

    # Another writer that adopts it too publishes the same metadata: PUBLISH_META takes it as the owner's retry.
    again = children.env(forgotten.config, forgotten.generation)
    served = find_served_buffer(children.runtime_dir, again.scope)
    assert served is not None and again.adopt_buffer(served) is True
    assert again.buffer is not None and _inode(again.buffer.memory.fd) == _inode(owner.buffer.memory.fd)


def test_an_adopter_whose_publication_lost_drops_what_it_mapped(children: Children, forgotten: Forgotten) -> None:
    owner = forgotten.owner
    assert owner.buffer is not None and owner.buffer.memory.fd is not None and owner.table is not None
    assert owner.table.fd is not None
    fresh = children.env(forgotten.config, forgotten.generation)  # a writer that allocated before anyone adopted
    assert fresh.publish_buffer(LAYOUT, b"\x00" * 8)
    late = children.env(forgotten.config, forgotten.generation)
    served = ServedBuffer(owner.meta_fields, os.dup(owner.buffer.memory.fd), os.dup(owner.table.fd))
    assert late.adopt_buffer(served) is False
    assert (late.buffer, late.table, late.server) == (None, None, None), "the loser dropped what it mapped"
    assert late.store.meta()["owner"] == fresh.proc.encode()


def test_a_served_buffer_that_does_not_fit_is_left_alone(children: Children, forgotten: Forgotten) -> None:
    other = children.env(dataclasses.replace(forgotten.config, shuffle_size=32), forgotten.generation)
    mapped_before = leaks.memfd_fds()
    served = find_served_buffer(children.runtime_dir, other.scope)
    assert served is not None, "the scope is the queue's on this Redis and node, whatever its size"
    assert other.adopt_buffer(served) is None, "16 slots do not make a 32-slot buffer"
    assert leaks.memfd_fds() == mapped_before, "the served fds were closed"
    assert other.buffer is None and other.store.meta() == {}
