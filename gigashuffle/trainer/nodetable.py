"""The trainer's handle on its node's slot table, and on the buffer metadata that a rejoin publishes again.

The trainer never reads rows from the buffer (batches come through the reader rings), but it maps the node's slot
table: it returns a dead child's slots (``repair``), answers ``stats()`` and ``evict()``, and hands the heartbeat
the counts that ``gigashuffle stats`` shows. Mapping the table is also the moment the trainer reads and verifies
the buffer's metadata, and keeps it: it is what the trainer publishes again when Redis forgot the session
(NOTE [ Rejoining ] in trainer/rejoin.py).

NOTE [ The trainer holds the buffer ]
The node buffer and its slot table are memfds: they live while some process maps them or holds an fd, and a new
process gets them only from one that serves them (NOTE [ Attach ] in procs/attach.py). If the writer that made them
died before any other child had attached (a loaded machine starts children late; a dataset that fails on its second
chunk), no process served them any more: every child started later waited ``redis_timeout_s`` and died with
``AttachError``, and the loader failed. So:
- a writer sends the buffer's and the table's memfds (``BufferOffer``) just before it publishes them: fds in
  flight keep the files alive, so the trainer gets them whenever the writer dies once its publication won. (They
  came with its ``Attached`` once, after the publication: an owner that died between the two left a published
  buffer nobody served, and the loader failed with ``AttachError`` whatever its ``max_restarts``.) The trainer keeps
  the offers until the published metadata names one by its ``owner`` field; the others lost the publication, and
  their fds are closed then;
- the trainer keeps an fd of each and serves them too, from its own attach socket in the runtime directory, not
  listed in Redis (``attach-<pid>-t<id>.sock``: several loaders may share a process); a child that no listed process
  answers finds it there (``find_served_buffer``, NOTE [ A buffer Redis forgot ]), as it would a child's;
- the server closes with the loader; the trainer's zygote removes the socket file of a trainer that was SIGKILLed.
A trainer that maps the table through an attach (a non-owner's ``Attached`` first, another rank's buffer) serves it
from then on as well.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from gigashuffle.config import DataloaderConfig
from gigashuffle.control.plane import NodeCounts
from gigashuffle.control.session import NodeSession
from gigashuffle.control.signedmeta import signed_meta, unsigned_fields, verified_layout
from gigashuffle.errors import AttachError, GigashuffleError, NodeLockBusy
from gigashuffle.host.pids import process_start
from gigashuffle.host.rundir import trainer_socket_path
from gigashuffle.host.secret import node_secret
from gigashuffle.procs import failpoints
from gigashuffle.procs.attach import AttachServer
from gigashuffle.procs.forgottenbuffer import attach_info, buffer_scope
from gigashuffle.procs.interrupts import critical
from gigashuffle.procs.nodefds import fetch_node_fds
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import SharedMemory, SlotBuffer
from gigashuffle.shm.prefault import fault_in_for_read
from gigashuffle.shm.slottable import SlotTable, table_nbytes

log = logging.getLogger(__name__)

# How long the trainer waits for the node lock to return a dead child's slots: children's housekeeping does it too.
_REPAIR_WAIT_S = 1.0
# How long one try to map the table waits for a child's attach socket to answer (the loader tries again later).
_ATTACH_TABLE_S = 2.0


class TableView:
    """The node's slot table as the trainer sees it: mapped on first use, closed with the loader."""

    def __init__(
        self,
        config: DataloaderConfig,
        session: NodeSession,
        runtime_path: Path,
        redis_url: str,
        *,
        map_rows: bool = False,
    ) -> None:
        self._config = config
        self._session = session
        self._secret = node_secret(runtime_path)
        self._runtime_path = runtime_path
        self._scope = buffer_scope(redis_url, config.queue_name, config.node)
        # NOTE [ The trainer holds the buffer ]: the buffer's fd kept to serve it, and the server.
        self._served_fd = -1
        self._server: AttachServer | None = None
        self._table: SlotTable | None = None
        self._mapping = threading.Lock()  # a monitor thread's metrics() and the loop may both map it first
        # Mapped only for a checkpoint's copy (NOTE [ Checkpoint cut ]): with ``map_rows`` (the rank that copies
        # the buffer at a checkpoint) together with the table, from the same fds, so that no checkpoint's pause
        # waits for an attach round trip; else on first use.
        self._map_rows = map_rows
        self._buffer: SlotBuffer | None = None
        self._faulted_in = False  # the buffer's and the table's pages are mapped into this process (rows_for_cut)
        self._meta_fields: dict[str, bytes] = {}  # the buffer's verified metadata, unsigned
        # Buffers this rank's writers offered before publishing, by their ``owner`` field: (buffer fd, table fd).
        self._offers: dict[bytes, tuple[int, int]] = {}

    def get(self) -> SlotTable | None:
        """The node's slot table, mapped on first use; None while no buffer is published or none is served."""
        if self._table is None and "hmac" in (meta := self._session.store.meta()):
            with self._mapping, critical():  # fds received are fds owned (NOTE [ Ctrl-C ] in procs/interrupts.py)
                if self._table is None:
                    self._map(meta)
        return self._table

    def offer(self, owner: bytes, buffer_fd: int, table_fd: int) -> None:
        """A buffer and table a writer of this rank is about to publish (NOTE [ The trainer holds the buffer ]),
        kept until the published metadata says whether they are the node's; both fds are this object's now."""
        with self._mapping, critical():  # fds received are fds owned (NOTE [ Ctrl-C ] in procs/interrupts.py)
            _close_pair(self._offers.pop(owner, None))
            self._offers[owner] = (buffer_fd, table_fd)
            if self._table is not None:
                self._drop_offers()
            elif "hmac" in (meta := self._session.store.meta()):
                self._map(meta)

    def _map(self, meta: dict[str, bytes]) -> None:
        """Map the published buffer's table: from the offer its ``owner`` names, else through an attach. The other
        offers lost the publication (or their writer died before it): their fds are closed."""
        offered = self._offers.pop(meta.get("owner", b""), None)
        self._drop_offers()
        try:
            if failpoints.ACTIVE:
                failpoints.reached("trainer.map_table")
            buffer_fd, table_fd = offered or fetch_node_fds(
                self._session.store, self._config.queue_name, _ATTACH_TABLE_S
            )
        except AttachError as exc:
            _close_pair(offered)
            log.debug("slot table not mapped yet: %s", exc)
            return
        except BaseException:
            _close_pair(offered)
            raise
        self._map_from(buffer_fd, table_fd)

    def _drop_offers(self) -> None:
        for pair in self._offers.values():
            _close_pair(pair)
        self._offers.clear()

    def _map_from(self, buffer_fd: int, table_fd: int) -> None:
        slots, stripes = self._config.shuffle_size, self._config.lock_stripes
        try:
            memory = SharedMemory(table_nbytes(slots, stripes), table_fd)
        except BaseException:
            os.close(table_fd)
            os.close(buffer_fd)
            raise
        self._table = SlotTable(slots, memory, stripes=stripes)
        self._keep_meta(buffer_fd)  # closes buffer_fd, or keeps the buffer mapped from it (map_rows)

    def layout(self) -> Layout | None:
        """The node buffer's row layout, from its published metadata (its HMAC checked); None while none is
        published. Nothing is mapped for it."""
        store = self._session.store
        meta = store.meta()
        if "hmac" not in meta:
            return None
        return verified_layout(self._secret, store.generation, meta, self._config.queue_name)

    def rows(self) -> SlotBuffer:
        """The node's buffer itself, mapped on first use: the trainer reads rows from it only for a checkpoint."""
        if self._buffer is None:
            store = self._session.store
            meta = store.meta()
            layout = verified_layout(self._secret, store.generation, meta, self._config.queue_name)
            with critical():  # fds received are fds owned (NOTE [ Ctrl-C ] in procs/interrupts.py)
                buffer_fd, table_fd = fetch_node_fds(store, self._config.queue_name, self._config.redis_timeout_s)
                os.close(table_fd)
                nbytes = int(meta["nbytes"])
                self._buffer = SlotBuffer(layout, self._config.shuffle_size, SharedMemory(nbytes, buffer_fd))
                self._buffer.memory.close_fd()
        return self._buffer

    def rows_for_cut(self) -> SlotBuffer:
        """``rows()``, with every page of the buffer and of the table mapped into this process: on the first call
        (one ``madvise`` each), before a checkpoint's pause, so the copy in the pause takes no page fault on
        them (NOTE [ Faulting in before the pause ] in shm/prefault.py). Later calls find them mapped."""
        buffer = self.rows()
        if not self._faulted_in:
            self._faulted_in = True
            buffer_bytes = buffer.memory.numpy_view(0, buffer.nbytes)
            fault_in_for_read(buffer_bytes)
            if self._table is not None:
                fault_in_for_read(self._table.state)
        return buffer

    def counts(self) -> NodeCounts | None:
        """The table's counts for the heartbeat (its thread; the table locks against ours)."""
        table = self._table
        if table is None:
            return None
        try:  # without the lock: a stopped lock holder must not stop the heartbeat (NOTE [ A stopped lock holder ])
            written, read, stats = table.counts()
            lock = table.lock_usage()
        except (ValueError, IndexError, OSError):  # closed meanwhile by shutdown(): its views and fd are gone
            return None
        at_ns = time.monotonic_ns()
        return NodeCounts(written, read, stats.full, stats.empty, stats.in_flight, round(lock.held_s * 1e9), at_ns)

    def republish(self) -> None:
        """Publish the kept metadata under the session's new generation (the first rank to do so wins)."""
        if self._meta_fields:
            store = self._session.store
            store.publish_meta(signed_meta(self._secret, store.generation, self._meta_fields))

    def _keep_meta(self, buffer_fd: int) -> None:
        """Keep the buffer's verified metadata; with ``map_rows`` map the buffer from ``buffer_fd`` too (a
        virtual mapping: nothing is touched until a checkpoint). ``buffer_fd`` is closed either way."""
        try:
            store = self._session.store
            meta = store.meta()
            try:
                layout = verified_layout(self._secret, store.generation, meta, self._config.queue_name)
            except GigashuffleError as exc:
                log.debug("buffer metadata not kept (a new session meanwhile?): %s", exc)
                return
            self._meta_fields = unsigned_fields(meta)
            self._serve(buffer_fd, int(meta["nbytes"]))
            if self._map_rows and self._buffer is None:
                try:
                    memory = SharedMemory(int(meta["nbytes"]), buffer_fd)
                except ValueError as exc:  # not this metadata's buffer: rows() maps the right one when needed
                    log.debug("buffer not mapped with the table: %s", exc)
                    return
                buffer_fd = -1  # the mapping owns it now
                memory.close_fd()
                self._buffer = SlotBuffer(layout, self._config.shuffle_size, memory)
        finally:
            if buffer_fd >= 0:
                os.close(buffer_fd)  # the trainer reads batches from the rings, never from the buffer

    def _serve(self, buffer_fd: int, nbytes: int) -> None:
        """Serve the buffer from this process (NOTE [ The trainer holds the buffer ]) with an fd of its own."""
        table = self._table
        if self._server is not None or table is None or table.fd is None or os.fstat(buffer_fd).st_size < nbytes:
            return  # serving already, or not this metadata's buffer: a child's attach answers for it
        served = os.dup(buffer_fd)
        try:
            path = trainer_socket_path(self._runtime_path)
            info = attach_info(self._scope, nbytes, self._meta_fields, (os.getpid(), process_start(os.getpid())))
            self._server = AttachServer(path, (served, table.fd), info)
        except OSError as exc:  # the children's own sockets still serve it; only the owner's early death is not covered
            os.close(served)
            log.warning("the trainer does not serve the node buffer (%s): its children still do", exc)
            return
        except BaseException:
            os.close(served)
            raise
        self._served_fd = served

    def repair_reaped(self, proc_id: str) -> None:
        """Return the slots of a child the zygote reaped (it no longer exists), mapping the table if need be."""
        try:
            table = self.get()
            if table is not None:
                repaired = table.repair(wait_s=_REPAIR_WAIT_S)
                log.debug("repaired %d slots of %s", repaired, proc_id)
        except NodeLockBusy as exc:  # NOTE [ A stopped lock holder ] in shm/slottable.py
            log.warning("%s; the slots of %s are returned by the next housekeeping after it", exc, proc_id)

    def repair_at_close(self) -> None:
        """At shutdown, once the zygote reaped this rank's children: other ranks' children go on, so give them
        what ours held (only when the table is mapped)."""
        table = self._table
        if table is None:
            return
        # Repair takes the slots of holders that no longer exist: a child still dying could commit or release
        # slots just repaired (its check of what it holds precedes the lock: NOTE [ Node lock budget ]), so
        # children the zygote did not reap are left to later housekeeping (theirs, or the other ranks').
        try:
            table.repair(wait_s=_REPAIR_WAIT_S)
        except NodeLockBusy as exc:  # their housekeeping returns them once the holder goes on
            log.warning("%s; this rank's slots are left to the other ranks' housekeeping", exc)

    def close(self, in_fork: bool = False) -> None:
        """Let go of the offers, the server, the served fd, the buffer and the table. ``in_fork``: in a fork's
        child, touching nothing the parent uses (NOTE [ Forks of the trainer ] in trainer/forks.py): the server's
        socket file stays, and the mappings go even under live views."""
        self._drop_offers()
        server, self._server = self._server, None
        if server is not None:
            server.forget_in_fork() if in_fork else server.close()
        if self._served_fd >= 0:
            os.close(self._served_fd)
            self._served_fd = -1
        buffer, table, self._buffer, self._table = self._buffer, self._table, None, None
        if buffer is not None:
            buffer.memory.forget() if in_fork else buffer.memory.close()
        if table is not None:
            table.memory.forget() if in_fork else table.close()  # its lock descriptions: shm/nodelock.py's hook


def _close_pair(fds: tuple[int, int] | None) -> None:
    if fds is not None:
        os.close(fds[0])
        os.close(fds[1])
