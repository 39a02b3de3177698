"""What every loader child shares: its spec, its Redis handle, and how it gets the node buffer.

``child_main`` is the entry point the zygote runs in each forked child; it hands over to ``writer.run`` or
``reader.run`` and, if they raise, sends the formatted traceback to the trainer before exiting, so the trainer
can raise it as the child's own error (as torch's ``ExceptionWrapper`` does for DataLoader workers).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .attach import AttachServer, attach
from .buffer import SharedMemory, SlotBuffer
from .channel import Channel
from .config import DataloaderConfig
from .errors import AttachError
from .keys import QueueKeys
from .meta import signed_meta, verified_layout
from .redisconn import connect
from .runtime import attach_socket_path, node_secret
from .schema import Layout
from .slots import SlotStore

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
    """The id under which a child's lease and attach socket are known in Redis."""
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
        self.store = SlotStore(self.client, QueueKeys(spec.config.queue_name, spec.config.node), spec.generation)
        self.runtime_dir = Path(spec.runtime_dir)
        self.secret = node_secret(self.runtime_dir)
        self.buffer: SlotBuffer | None = None
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
        """Allocate the buffer and publish it, unless another process got there first; True if we own it."""
        buffer = SlotBuffer(layout, self.config.shuffle_size)
        fields = {
            "layout": layout.to_json().encode(),
            "slots": str(self.config.shuffle_size).encode(),
            "first_row": first_row,
            "owner": self.proc.encode(),
            "nbytes": str(buffer.nbytes).encode(),
        }
        # Listen before publishing, but list the socket in Redis only once the seed is won: a loser's own buffer
        # must never be handed out (a reader that attached through it would gather zeros forever).
        self.buffer, self.owner = buffer, True
        self._serve(register=False)
        if self.store.seed(self.config.shuffle_size, signed_meta(self.secret, self.spec.generation, fields)):
            self.register()
            _retitle(" owner")
            return True
        if self.server is not None:
            self.server.close()
        self.server, self.buffer, self.owner = None, None, False
        buffer.close()
        return False

    def read_meta(self) -> tuple[Layout, dict[str, bytes]]:
        """Wait for the published metadata and check its HMAC."""
        backoff = Backoff(cap_s=0.05)
        while "hmac" not in (meta := self.store.meta()):
            backoff.sleep()
        return verified_layout(self.secret, self.spec.generation, meta, self.config.queue_name), meta

    def attach_buffer(self) -> Layout:
        """Map the published buffer through any process that serves it, then serve it ourselves."""
        layout, meta = self.read_meta()
        nbytes = int(meta["nbytes"])
        deadline = time.monotonic() + self.config.redis_timeout_s
        backoff = Backoff(cap_s=0.05)
        errors: list[str] = []
        while self.buffer is None:
            for info in self.store.processes().values():
                path = info.get("attach")
                if not path:
                    continue
                try:
                    _info, fds = attach(path)
                except AttachError as exc:
                    errors.append(str(exc))
                    continue
                for extra_fd in fds[1:]:
                    os.close(extra_fd)
                self.buffer = SlotBuffer(layout, self.config.shuffle_size, SharedMemory(nbytes, fds[0]))
                break
            if self.buffer is None:
                if time.monotonic() > deadline:
                    raise AttachError(f"no process serves the buffer of {self.config.queue_name!r}: {errors[-3:]}")
                backoff.sleep()
        self._serve()
        return layout

    def _serve(self, register: bool = True) -> None:
        if self.buffer is None or self.buffer.memory.fd is None:
            raise AssertionError("serving a buffer this process does not hold")
        path = attach_socket_path(os.getpid(), self.runtime_dir)
        self.server = AttachServer(path, (self.buffer.memory.fd,), {"nbytes": self.buffer.nbytes})
        if register:
            self.register()


def _retitle(suffix: str = "", title: str | None = None) -> None:
    try:
        import setproctitle
    except ImportError:
        log.debug("setproctitle is not installed")
        return
    setproctitle.setproctitle((title or setproctitle.getproctitle()) + suffix)


def child_main(payload: bytes, title: str, control_fd: int) -> int:
    """Run one child; returns its exit code. Errors go to the trainer as text before the child exits."""
    channel = Channel(socket.socket(fileno=control_fd))
    _retitle(title=title)
    try:
        spec: ChildSpec = pickle.loads(payload)
        import torch

        torch.set_num_threads(1)  # many children per node: one intra-op thread each avoids oversubscription
        if spec.role == "writer":
            from . import writer

            writer.run(spec, channel)
        else:
            from . import reader

            reader.run(spec, channel)
    except BaseException as exc:
        try:
            channel.send(("error", type(exc).__name__, traceback.format_exc()))
        except OSError:
            log.debug("trainer is gone; error not reported")
        return 1
    return 0
