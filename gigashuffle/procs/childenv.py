"""What every loader child shares: its spec, its Redis handle, and how it gets the node buffer and slot table.

The loops themselves (``procs/writer.py``, ``procs/reader.py``) import this module, never the other way round; the entry
point that picks one is ``procs/childmain.py``.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gigashuffle.config import DataloaderConfig
from gigashuffle.control import dummyrow
from gigashuffle.control.client import connect
from gigashuffle.control.keys import QueueKeys
from gigashuffle.control.plane import ControlPlane
from gigashuffle.control.signedmeta import same_buffer, signed_meta, unsigned_fields, verified_layout
from gigashuffle.errors import AttachError, GigashuffleError, QueueStateLostError
from gigashuffle.host.rundir import attach_socket_path
from gigashuffle.host.secret import node_secret
from gigashuffle.procs.attach import AttachServer, attach
from gigashuffle.procs.channel import Channel
from gigashuffle.procs.forgottenbuffer import (
    ServedBuffer,
    attach_info,
    buffer_scope,
    find_served_buffer,
    trainer_of_this_child,
)
from gigashuffle.procs.messages import Role
from gigashuffle.resumepoint import ResumePoint
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import SharedMemory, SlotBuffer
from gigashuffle.shm.slottable import SlotTable, table_nbytes

log = logging.getLogger(__name__)

# How often a child returns slots of dead holders (the trainer does so at once for its own children).
_REPAIR_PERIOD_S = 1.0
# The fallback pass over every slot (NOTE [ Holder registry ] in shm/holders.py): rare, it holds the node lock.
_SCAN_PERIOD_S = 600.0


class _NoContext(enum.Enum):
    # An enum member, not object(): it stays the same object after the spec is unpickled in the child.
    UNSET = "no training context"


NO_CONTEXT = _NoContext.UNSET  # "no context was given", which None (a valid context) cannot say


@dataclass
class ChildSpec:
    """Everything a child needs, pickled by the trainer and unpickled in the child."""

    role: Role
    index: int
    config: DataloaderConfig
    redis_url: str
    generation: str
    runtime_dir: str
    dataset: Any = None
    context: Any = NO_CONTEXT  # the training context given so far (attach_training_context), if any
    seed: int = 0  # the job's base seed (NOTE [ Seeds ] in procs/seeds.py)
    start: int = 0  # how often the trainer started this writer before: a respawn draws a fresh stream
    # NOTE [ Respawned writers ] and [ Restore before reading ] in procs/resume.py:
    stateful: bool = False  # the dataset has state_dict/load_state_dict: track where commits are
    go: bool = True  # False: hold before committing any row until the trainer sends Go or LoadState
    epoch: int | None = None  # the last loader.set_epoch(), for a writer started after it
    point: ResumePoint = field(default_factory=ResumePoint)  # where a writer starts (gigashuffle/resumepoint.py)


def proc_name(global_rank: int, role: str, index: int, pid: int) -> str:
    """The id under which a child is registered in Redis (its entry in the queue's ``procs`` hash)."""
    return f"{global_rank}.{role[0]}{index}.{pid}"


class Backoff:
    """Sleeps that start near 0.5 ms and double up to ``cap_s``: idle waits stay cheap, busy ones short."""

    def __init__(self, cap_s: float = 0.008, first_s: float = 0.0005) -> None:
        self.cap_s = cap_s
        self.first_s = first_s
        self.next_s = first_s

    def reset(self) -> None:
        self.next_s = self.first_s

    def sleep(self) -> None:
        time.sleep(self.next_s)
        self.next_s = min(self.next_s * 2, self.cap_s)


class ChildEnv:
    """A child's connection to the world: its trainer channel, Redis, and its share of the node buffer."""

    def __init__(self, spec: ChildSpec, channel: Channel) -> None:
        self.spec = spec
        self.channel = channel
        self.config = spec.config
        self.proc = proc_name(spec.config.global_rank, spec.role, spec.index, os.getpid())
        self.client = connect(spec.redis_url, spec.config.redis_timeout_s)
        self.store = ControlPlane(self.client, QueueKeys(spec.config.queue_name, spec.config.node), spec.generation)
        self.runtime_dir = Path(spec.runtime_dir)
        self.secret = node_secret(self.runtime_dir)
        self.scope = buffer_scope(spec.redis_url, spec.config.queue_name, spec.config.node)
        self.trainer = trainer_of_this_child()  # said in the attach reply: NOTE [ A buffer Redis forgot ]
        self.buffer: SlotBuffer | None = None
        self.table: SlotTable | None = None
        self.server: AttachServer | None = None
        self.owner = False
        self.meta_fields: dict[str, bytes] = {}  # the buffer's metadata as published, unsigned
        self.dummy_row: tuple[bytes, bytes] | None = None  # (layout JSON, row) if this writer published it
        self.register()

    def register(self, **extra: Any) -> None:
        info = {
            "role": self.spec.role,
            "index": self.spec.index,
            "rank": self.config.global_rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "owner": self.owner,
            **extra,
        }
        if self.server is not None:
            info["attach"] = str(self.server.path)
        self.store.register(self.proc, info)

    # -- the node buffer -------------------------------------------------------------------------------------
    def publish_buffer(self, layout: Layout, first_row: bytes) -> bool:
        """Allocate the buffer and its slot table and publish them, unless another process got there first; True
        if we own them."""
        buffer = SlotBuffer(layout, self.config.shuffle_size)
        table = SlotTable(self.config.shuffle_size, stripes=self.config.lock_stripes)
        fields = {
            "layout": layout.to_json().encode(),
            "slots": str(self.config.shuffle_size).encode(),
            "first_row": first_row,
            "owner": self.proc.encode(),
            "nbytes": str(buffer.nbytes).encode(),
        }
        # Listen before publishing, but list the socket in Redis only once its metadata publication won: a loser's own
        # buffer
        # must never be handed out (a reader that attached through it would gather zeros forever).
        self.buffer, self.table, self.owner = buffer, table, True
        if not self._publish(fields):
            return False
        retitle(" owner")
        return True

    def adopt_buffer(self, served: ServedBuffer) -> bool | None:
        """Map a buffer another process of the node serves though Redis lists none, and publish it again (NOTE
        [ A buffer Redis forgot ] in procs/forgottenbuffer.py): True if ours is the publication that won, False if
        another one did, None (its fds closed) if that buffer does not fit this loader's configuration."""
        slots, fields = self.config.shuffle_size, served.fields
        try:
            layout, nbytes = Layout.from_json(fields["layout"]), int(fields["nbytes"])
            fits = int(fields["slots"]) == slots
        except (KeyError, ValueError, GigashuffleError) as exc:
            log.warning("ignoring a served buffer with unreadable metadata: %s", exc)
            fits = False
        if not fits:
            os.close(served.buffer_fd)
            os.close(served.table_fd)
            return None
        self.buffer = SlotBuffer(layout, slots, SharedMemory(nbytes, served.buffer_fd))
        stripes = self.config.lock_stripes
        self.table = SlotTable(slots, SharedMemory(table_nbytes(slots, stripes), served.table_fd), stripes=stripes)
        return self._publish(fields)

    def _publish(self, fields: dict[str, bytes]) -> bool:
        """Serve the buffer this process holds and publish its metadata; if another publication won, drop it."""
        self.meta_fields = fields
        self._serve(register=False)
        won = False
        try:
            won = self.store.publish_meta(signed_meta(self.secret, self.spec.generation, fields))
        finally:
            if not won:
                self._drop_buffer()
        if won:
            self._announce()
            self.register()
        return won

    def _drop_buffer(self) -> None:
        if self.server is not None:
            self.server.close()
        for resource in (self.buffer, self.table):
            if resource is not None:
                resource.close()
        self.server, self.buffer, self.table, self.owner, self.meta_fields = None, None, None, False, {}

    def read_meta(self) -> tuple[Layout, dict[str, bytes]]:
        """Wait for the published metadata and check its HMAC."""
        backoff = Backoff(cap_s=0.05)
        while "hmac" not in (meta := self.store.meta()):
            self._raise_if_stale()
            backoff.sleep()
        try:
            return verified_layout(self.secret, self.spec.generation, meta, self.config.queue_name), meta
        except GigashuffleError:
            self._raise_if_stale()  # metadata of a newer session, signed for its generation: not tampered with
            raise

    def _raise_if_stale(self) -> None:
        current = self.store.generation_now()
        if current != self.spec.generation:
            raise QueueStateLostError(
                f"the session {self.spec.generation} of queue {self.config.queue_name!r} is gone (now {current}); "
                "the trainer starts this process again under the new one"
            )

    def attach_buffer(self) -> Layout:
        """Map the published buffer and slot table through any process that serves them, then serve them too."""
        layout, meta = self.read_meta()
        self.meta_fields = unsigned_fields(meta)
        slots = self.config.shuffle_size
        timeout_s = self.config.redis_timeout_s
        buffer_fd, table_fd = fetch_node_fds(self.store, self.config.queue_name, timeout_s, self._served_unlisted)
        self.buffer = SlotBuffer(layout, slots, SharedMemory(int(meta["nbytes"]), buffer_fd))
        stripes = self.config.lock_stripes
        self.table = SlotTable(slots, SharedMemory(table_nbytes(slots, stripes), table_fd), stripes=stripes)
        self._serve()
        return layout

    def _served_unlisted(self) -> tuple[int, int] | None:
        """The published buffer's fds from a process of this node that serves it but is not listed in Redis: a
        new session wiped the list, and the processes that map the buffer list themselves again only as they
        take the trainer's ``Rejoin`` (NOTE [ Rejoining ] in trainer/rejoin.py). Raises if our session is gone."""
        self._raise_if_stale()
        served = find_served_buffer(self.runtime_dir, self.scope)
        if served is None:
            return None
        if same_buffer(served.fields, self.meta_fields):
            return served.buffer_fd, served.table_fd
        os.close(served.buffer_fd)  # another buffer than the published one (one a new session replaced)
        os.close(served.table_fd)
        return None

    def _serve(self, register: bool = True) -> None:
        if self.buffer is None or self.buffer.memory.fd is None or self.table is None or self.table.fd is None:
            raise AssertionError("serving a buffer this process does not hold")
        path = attach_socket_path(os.getpid(), self.runtime_dir)
        fds = (self.buffer.memory.fd, self.table.fd)
        # Found in the runtime directory only once published: NOTE [ A buffer Redis forgot ].
        scope = self.scope if register else None
        self.server = AttachServer(path, fds, attach_info(scope, self.buffer.nbytes, self.meta_fields, self.trainer))
        if register:
            self.register()

    def _announce(self) -> None:
        """Say the scope in the attach reply of a buffer whose publication won."""
        if self.server is not None and self.buffer is not None:
            self.server.set_info(attach_info(self.scope, self.buffer.nbytes, self.meta_fields, self.trainer))

    # -- a new session (NOTE [ Rejoining ] in trainer/rejoin.py) ---------------------------------------------------
    def rejoin(self, generation: str) -> None:
        """Quote ``generation`` from now on; register again and publish the buffer and the dummy row under it."""
        log.info("%s rejoins queue %r under session %s", self.proc, self.config.queue_name, generation)
        self.spec.generation = self.store.generation = generation
        self.register()
        if self.buffer is not None and self.meta_fields:  # the trainer did so too; whoever is first wins
            self.store.publish_meta(signed_meta(self.secret, generation, self.meta_fields))
        if self.dummy_row is not None:
            layout_json, row = self.dummy_row
            dummyrow.publish_row(self.store, self.secret, generation, layout_json, row, self.proc)

    def close(self) -> None:
        """Stop serving the buffer and drop this process's mappings and Redis connections."""
        if self.server is not None:
            self.server.close()
            self.server = None
        for resource in (self.buffer, self.table):
            if resource is not None:
                resource.close()
        self.buffer = self.table = None
        self.client.close()


def fetch_node_fds(
    store: ControlPlane, queue: str, timeout_s: float, fallback: Callable[[], tuple[int, int] | None] | None = None
) -> tuple[int, int]:
    """The node buffer's memfd and its slot table's, from any process that serves them (the caller closes them).
    ``fallback`` is asked after each round that Redis's list of processes did not answer (it may raise)."""
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(cap_s=0.05)
    errors: list[str] = []
    while True:
        fds = _fds_from_listed(store, errors)
        if fds is None and fallback is not None:
            fds = fallback()
        if fds is not None:
            return fds
        if time.monotonic() > deadline:
            raise AttachError(f"no process serves the buffer of {queue!r}: {errors[-3:]}")
        backoff.sleep()


def _fds_from_listed(store: ControlPlane, errors: list[str]) -> tuple[int, int] | None:
    """One round through the processes Redis lists as serving the buffer."""
    for info in store.processes().values():
        path = info.get("attach")
        if not path:
            continue
        try:
            _info, fds = attach(path)
        except AttachError as exc:
            errors.append(str(exc))
            continue
        if len(fds) == 2:
            return fds[0], fds[1]
        for fd in fds:
            os.close(fd)
        errors.append(f"{path} sent {len(fds)} fds, not the buffer's and the slot table's")
    return None


class Housekeeping:
    """What a child does about once a second, off the hot path: return the slots of dead holders (a /proc read per
    holder, the lock only after a death), and every ``scan_s`` the fallback pass over the whole table. No Redis:
    the trainers' heartbeats record the node's counts (NOTE [ Control plane ] in control/lua.py)."""

    def __init__(self, env: ChildEnv, period_s: float = _REPAIR_PERIOD_S, scan_s: float = _SCAN_PERIOD_S) -> None:
        self.env = env
        self.period_s, self.scan_s = period_s, scan_s
        self._due = time.monotonic() + period_s
        self._scan_due = time.monotonic() + scan_s

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + self.period_s
        scan = now >= self._scan_due
        if scan:
            self._scan_due = now + self.scan_s
        table = self.env.table
        if table is not None and (repaired := table.repair(scan=scan)):
            log.info("returned %d slots of dead processes", repaired)


def retitle(suffix: str = "", title: str | None = None) -> None:
    try:
        import setproctitle
    except ImportError:
        log.debug("setproctitle is not installed")
        return
    setproctitle.setproctitle((title or setproctitle.getproctitle()) + suffix)
