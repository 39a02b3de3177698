"""What every loader child shares: its Redis handle, and how it gets the node buffer and slot table.

What it is given is its ``ChildSpec`` (``procs/childspec.py``); what it does while it waits, ``procs/chores.py``. The
loops themselves (``procs/writer.py``, ``procs/reader.py``) import these modules, never the other way round; the
entry point that picks one is ``procs/childmain.py``.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

from gigashuffle.control import dummyrow
from gigashuffle.control.client import connect
from gigashuffle.control.keys import QueueKeys
from gigashuffle.control.plane import ControlPlane
from gigashuffle.control.signedmeta import same_buffer, signed_meta, unsigned_fields, verified_layout
from gigashuffle.errors import GigashuffleError, QueueStateLostError
from gigashuffle.host.memory import refuse_a_buffer_too_large
from gigashuffle.host.rundir import attach_socket_path
from gigashuffle.host.secret import node_secret
from gigashuffle.procs import failpoints
from gigashuffle.procs.attach import AttachServer
from gigashuffle.procs.channel import Channel
from gigashuffle.procs.childspec import ChildSpec, proc_name, retitle
from gigashuffle.procs.chores import Backoff
from gigashuffle.procs.forgottenbuffer import (
    ServedBuffer,
    attach_info,
    buffer_scope,
    find_served_buffer,
    trainer_of_this_child,
)
from gigashuffle.procs.messages import BufferOffer
from gigashuffle.procs.nodefds import fetch_node_fds
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import SharedMemory, SlotBuffer, buffer_nbytes
from gigashuffle.shm.slottable import SlotTable, table_nbytes

log = logging.getLogger(__name__)


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
        cfg = self.config
        need = buffer_nbytes(layout, cfg.shuffle_size) + table_nbytes(cfg.shuffle_size, cfg.lock_stripes)
        refuse_a_buffer_too_large(need, cfg.shuffle_size, layout.row_bytes, cfg.queue_name)
        buffer = SlotBuffer(layout, cfg.shuffle_size)
        table = SlotTable(cfg.shuffle_size, stripes=cfg.lock_stripes)
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
        """Serve the buffer this process holds, offer it to the trainer and publish its metadata; if another
        publication won, drop it."""
        self.meta_fields = fields
        self._serve(register=False)
        self._offer(fields["owner"])
        if failpoints.ACTIVE:
            failpoints.reached("writer.before_publish")
        won = False
        try:
            won = self.store.publish_meta(signed_meta(self.secret, self.spec.generation, fields))
            if won and failpoints.ACTIVE:
                failpoints.reached("writer.after_publish")
        finally:
            if not won:
                self._drop_buffer()
        if won:
            self._announce()
            self.register()
        return won

    def _offer(self, owner: bytes) -> None:
        """Send the trainer the buffer's and the table's fds before the publication (NOTE [ The trainer holds the
        buffer ] in trainer/nodetable.py): in flight or held, they keep both alive if this process dies after its
        publication won and before any other process attached."""
        if self.buffer is None or self.buffer.memory.fd is None or self.table is None or self.table.fd is None:
            raise AssertionError("offering a buffer this process does not hold")
        self.channel.send(BufferOffer(owner), (self.buffer.memory.fd, self.table.fd))

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
