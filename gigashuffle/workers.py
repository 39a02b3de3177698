"""What every loader child shares: its spec, its Redis handle, and how it gets the node buffer and slot table.

The loops themselves (``writer.py``, ``reader.py``) import this module, never the other way round; the entry
point that picks one is ``child.py``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .attach import AttachServer, attach
from .buffer import SharedMemory, SlotBuffer
from .channel import Channel
from .config import DataloaderConfig
from .control import FLUSH_PERIOD_S, ControlPlane
from .errors import AttachError
from .keys import QueueKeys
from .meta import signed_meta, verified_layout
from .redisconn import connect
from .runtime import attach_socket_path, node_secret
from .schema import Layout
from .slottable import SlotTable, table_nbytes

log = logging.getLogger(__name__)


@dataclass
class ChildSpec:
    """Everything a child needs, pickled by the trainer and unpickled in the child."""

    role: str
    index: int
    config: DataloaderConfig
    redis_url: str
    generation: str
    runtime_dir: str
    dataset: Any = None
    context: Any = None
    dataset_state: Any = None
    has_context: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    seed: int = 0  # the job's base seed (NOTE [ Seeds ] in seeds.py)
    start: int = 0  # how often the trainer started this writer before: a respawn draws a fresh stream


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
        self.buffer: SlotBuffer | None = None
        self.table: SlotTable | None = None
        self.server: AttachServer | None = None
        self.owner = False
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
        table = SlotTable(self.config.shuffle_size)
        fields = {
            "layout": layout.to_json().encode(),
            "slots": str(self.config.shuffle_size).encode(),
            "first_row": first_row,
            "owner": self.proc.encode(),
            "nbytes": str(buffer.nbytes).encode(),
        }
        # Listen before publishing, but list the socket in Redis only once the seed is won: a loser's own buffer
        # must never be handed out (a reader that attached through it would gather zeros forever).
        self.buffer, self.table, self.owner = buffer, table, True
        self._serve(register=False)
        if self.store.seed(signed_meta(self.secret, self.spec.generation, fields)):
            self.register()
            retitle(" owner")
            return True
        if self.server is not None:
            self.server.close()
        self.server, self.buffer, self.table, self.owner = None, None, None, False
        buffer.close()
        table.close()
        return False

    def read_meta(self) -> tuple[Layout, dict[str, bytes]]:
        """Wait for the published metadata and check its HMAC."""
        backoff = Backoff(cap_s=0.05)
        while "hmac" not in (meta := self.store.meta()):
            backoff.sleep()
        return verified_layout(self.secret, self.spec.generation, meta, self.config.queue_name), meta

    def attach_buffer(self) -> Layout:
        """Map the published buffer and slot table through any process that serves them, then serve them too."""
        layout, meta = self.read_meta()
        slots = self.config.shuffle_size
        buffer_fd, table_fd = fetch_node_fds(self.store, self.config.queue_name, self.config.redis_timeout_s)
        self.buffer = SlotBuffer(layout, slots, SharedMemory(int(meta["nbytes"]), buffer_fd))
        self.table = SlotTable(slots, SharedMemory(table_nbytes(slots), table_fd))
        self._serve()
        return layout

    def _serve(self, register: bool = True) -> None:
        if self.buffer is None or self.buffer.memory.fd is None or self.table is None or self.table.fd is None:
            raise AssertionError("serving a buffer this process does not hold")
        path = attach_socket_path(os.getpid(), self.runtime_dir)
        fds = (self.buffer.memory.fd, self.table.fd)
        self.server = AttachServer(path, fds, {"nbytes": self.buffer.nbytes})
        if register:
            self.register()


def fetch_node_fds(store: ControlPlane, queue: str, timeout_s: float) -> tuple[int, int]:
    """The node buffer's memfd and its slot table's, from any process that serves them (the caller closes them)."""
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(cap_s=0.05)
    errors: list[str] = []
    while True:
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
        if time.monotonic() > deadline:
            raise AttachError(f"no process serves the buffer of {queue!r}: {errors[-3:]}")
        backoff.sleep()


class Housekeeping:
    """What a child does about once a second, off the hot path: repair slots of dead holders, flush counters."""

    def __init__(self, env: ChildEnv, period_s: float = FLUSH_PERIOD_S) -> None:
        self.env = env
        self.period_s = period_s
        self.written = 0
        self.read = 0
        self._due = time.monotonic()  # the first tick flushes: stats show the buffer as soon as it exists

    def tick(self) -> None:
        if time.monotonic() < self._due:
            return
        self._due = time.monotonic() + self.period_s
        table = self.env.table
        if table is None:
            return
        repaired = table.repair()
        if repaired:
            log.info("returned %d slots of dead processes", repaired)
        stats = table.snapshot().stats()
        self.env.store.flush_counters(self.written, self.read, stats.full, stats.empty, stats.in_flight)
        self.written = self.read = 0


def retitle(suffix: str = "", title: str | None = None) -> None:
    try:
        import setproctitle
    except ImportError:
        log.debug("setproctitle is not installed")
        return
    setproctitle.setproctitle((title or setproctitle.getproctitle()) + suffix)
