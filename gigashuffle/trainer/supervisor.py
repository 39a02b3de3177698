"""The trainer's supervisor: spawns the children, reads their messages, notices deaths, and tears down.

NOTE [ Supervision ]
The trainer never blocks on one thing: every wait is a ``select`` over the zygote's channel and every child's
channel with a timeout of at most ``_PUMP_S``, so a child's death (reported by the zygote with its exit status)
or a lost Redis session (once the heartbeat saw it: NOTE [ Heartbeat ]) is seen within about a second even while
the trainer waits for a batch. A child that raised sends a ``ChildError`` (type and traceback) before exiting;
the trainer raises that text in a ``WorkerDied``. A dead child's slots are repaired in the slot table at once
(when the trainer has mapped it; else the other children's once-a-second repair finds the dead pid), and with
``max_restarts`` left it is spawned again.
When the session itself is lost, the trainer rejoins (NOTE [ Rejoining ] in trainer/rejoin.py). ``shutdown()`` is
idempotent and runs from the loader's ``weakref.finalize`` callback, so it must not refer to the loader object.

The supervisor knows children, not checkpoints: what the checkpoint package needs of it it gets through events
(``on(message type)``, ``on_writer_death``, ``on_close``), one ``send``, and the ``WriterStarts`` it is given, which
says where each writer starts and whether children started now start held (a cut is on).
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from gigashuffle.config import DataloaderConfig
from gigashuffle.control.link import ControlLink
from gigashuffle.errors import GigashuffleError, QueueStateLostError, WorkerDied
from gigashuffle.host.rundir import attach_socket_path, remove_socket
from gigashuffle.procs.channel import ChannelClosed
from gigashuffle.procs.childenv import proc_name
from gigashuffle.procs.interrupts import critical
from gigashuffle.procs.messages import (
    Attached,
    BatchReady,
    ChildError,
    Go,
    MixShare,
    PassEnd,
    RingReady,
    Role,
    SetContext,
    SetEpoch,
    Spawned,
    ToChild,
    ZygoteEvent,
)
from gigashuffle.procs.pickling import dumps_by_value
from gigashuffle.procs.zygoteclient import ChildProcess, Zygote
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import BatchRing, SharedMemory
from gigashuffle.shm.counters import ChildCounters
from gigashuffle.shm.lanes import NO_LANE, reader_lane, writer_lanes
from gigashuffle.shm.slottable import SlotTable
from gigashuffle.trainer import rejoin
from gigashuffle.trainer.childspecs import ChildSpecs, WriterStarts
from gigashuffle.trainer.inbox import Inbox
from gigashuffle.trainer.nodetable import TableView
from gigashuffle.trainer.pinning import Placement

log = logging.getLogger(__name__)

_PUMP_S = 0.25
# How long a dead child's lanes wait for the node lock before they are read around a stopped holder.
_LANE_WAIT_S = 1.0

M = TypeVar("M")
# A message handler: the child, its message, the fds that came with it (the handler owns them).
Handler = Callable[[ChildProcess, Any, list[int]], None]
# Lane values once any op a dead child was inside is rolled forward (None: the table is not mapped).
LaneReader = Callable[[tuple[int, ...]], "tuple[int, ...] | None"]
# A writer died: its index, its lanes (NOTE [ Lanes ]) and how to read them; called before its slots are repaired.
# An error returned: its successor cannot start exactly, so the loader stops with it instead of respawning.
DeathHandler = Callable[[int, tuple[int, int], LaneReader], "GigashuffleError | None"]


class Supervisor:
    def __init__(
        self,
        config: DataloaderConfig,
        dataset: Any,
        link: ControlLink,
        runtime_dir: str,
        placement: Placement,
        starts: WriterStarts,
        stateful: bool = False,
    ) -> None:
        self.config = config
        self.dataset = dataset
        self.link = link  # closed last by shutdown(): NOTE [ Shutdown ] in trainer/teardown.py
        self.client = link.client
        self.redis_url = link.url
        session = self.session = link.session
        self.stateful = stateful
        self.runtime_dir = runtime_dir
        self.runtime_path = Path(runtime_dir)
        self.children: list[ChildProcess] = []
        self.inbox = Inbox(placement, self.children)  # the ring slots of this rank's readers
        self._on_ring = placement.adopt  # a reader's ring arrived: rings are registered with CUDA then, not per batch
        self._handlers: dict[type, Handler] = {}  # on(): the checkpoint package's messages
        self._death_handlers: list[DeathHandler] = []
        self._close_handlers: list[Callable[[], None]] = []
        self._pumping = threading.RLock()  # see pump()
        self._mix_shares: set[int] = set()  # writers that sent MixShare (NOTE [ First mix ] in procs/firstmix.py)
        self.failure: BaseException | None = None
        self._closed = False
        self._restarts = 0  # children started again after a death (for metrics(); rejoins are not restarts)
        # The rank that copies the buffer at a checkpoint maps it with the table (NOTE [ Checkpoint cut ], in
        # the mode of DataloaderConfig.delivers_once); a dataset without state is never checkpointed.
        copies = stateful and config.local_rank == 0 and config.delivers_once
        self.node_table = TableView(config, session, self.runtime_path, map_rows=copies)
        session.counts = self.node_table.counts
        self._starts = starts
        self._specs = ChildSpecs(config, dataset, link, runtime_dir, stateful, starts)
        self.seed = self._specs.seed
        self._zygote_title = f"gigashuffle zygote {config.queue_name} rank={config.global_rank}"
        self.zygote = Zygote(self._zygote_title)
        try:
            for role, index in self._specs.every_child():
                self.children.append(self._spawn(role, index, restarts=0))
        except BaseException:
            # E.g. an unpicklable dataset: the loader gets no Supervisor to shut down, so stop the zygote now.
            self.zygote.close()
            for child in self.children:
                child.channel.close()
            raise

    # -- read-only figures ----------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def go(self) -> bool:
        """Whether writers read their datasets (NOTE [ Restore before reading ] in procs/resume.py)."""
        return self._specs.go

    @property
    def restarts(self) -> int:
        """Children started again after a death (for metrics(); rejoins are not restarts)."""
        return self._restarts

    def late_writers(self) -> list[int]:
        """The live writers that have not written their share of the node's first mix (NOTE [ First mix ])."""
        return sorted(c.index for c in self.writers() if c.index not in self._mix_shares)

    # -- spawning (what each child is given: trainer/childspecs.py) ----------------------------------------
    def _spawn(self, role: Role, index: int, restarts: int) -> ChildProcess:
        cfg = self.config
        title = f"gigashuffle {role} {cfg.queue_name} rank={cfg.global_rank} proc={index}"
        held = self._starts.held()  # a cut is on: a writer starts held, a reader gets its Pause first
        seq, channel = self.zygote.spawn(self._specs.spec(role, index, held=held is not None), title)
        if role == "reader" and held is not None:
            channel.send(held)  # read before its first draw
        return ChildProcess(role, index, seq, channel, restarts, generation=self.session.generation)

    # -- events for the checkpoint package (checkpoint/checkpoints.py) ----------------------------------------
    def on(self, kind: type[M], handler: Callable[[ChildProcess, M, list[int]], None]) -> None:
        """Call ``handler(child, message, fds)`` for every message of type ``kind`` (one handler per type)."""
        self._handlers[kind] = handler

    def on_writer_death(self, handler: DeathHandler) -> None:
        """Call ``handler`` when a writer of a stateful dataset dies, before its slots are repaired."""
        self._death_handlers.append(handler)

    def on_close(self, handler: Callable[[], None]) -> None:
        """Call ``handler`` at shutdown, after every child is stopped."""
        self._close_handlers.append(handler)

    def send(self, child: ChildProcess, message: ToChild) -> bool:
        """Send ``message`` to ``child``; False when it is dying (the zygote reports its exit, and a successor
        starts from its spec)."""
        try:
            child.channel.send(message)
        except OSError:
            return False
        return True

    # -- the message pump ------------------------------------------------------------------------------------
    def pump(self, timeout: float = _PUMP_S) -> None:
        """Handle whatever the zygote and the children sent, waiting up to ``timeout`` for the first message.

        One thread at a time: a loader used from two threads (a training loop, and a monitor calling
        ``child_pids()``, which pumps until a respawned child's pid is known) would otherwise read one channel from
        both, one thread taking a message's header and the other its payload as the next header, and both then
        wait for bytes that never come (seen as a 60 s hang right after a respawn in the chaos tests)."""
        with self._pumping:
            self._pump(timeout)

    def _pump(self, timeout: float) -> None:
        self.raise_if_failed()
        self.inbox.flush()
        live = [c for c in self.children if c.alive]
        readable, _, _ = select.select([self.zygote.channel, *(c.channel for c in live)], [], [], timeout)
        for child in live:
            if child.channel in readable:
                self._drain(child)
        self._handle_zygote_events()
        if self.session.lost is not None and self.failure is None:
            self._rejoin(self.session.lost)
        self.raise_if_failed()

    def _handle_zygote_events(self) -> None:
        # Read and handled in one section: an event read and dropped is a child never known dead (NOTE [ Ctrl-C ]).
        with critical():
            for event in self.zygote.events():
                self._on_zygote_event(event)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _drain(self, child: ChildProcess) -> None:
        try:
            while child.channel.poll(0):
                with critical():  # a message read by half leaves the stream out of frame (NOTE [ Ctrl-C ])
                    message, fds = child.channel.recv()
                    self._on_message(child, message, fds)
        except (ChannelClosed, ConnectionError):
            return  # the zygote reports the exit status; the error text, if any, was read above

    def _on_message(self, child: ChildProcess, message: object, fds: list[int]) -> None:
        if isinstance(message, BatchReady):
            self.inbox.announced(child, message.ks)
        elif isinstance(message, RingReady):
            memory = SharedMemory(message.nbytes, fds[0])
            memory.close_fd()
            layout = Layout.from_json(message.layout_json)
            child.ring = BatchRing(layout, self.config.bs, message.depth, memory)
            self._map_counters(child, fds[1:])
            self._on_ring(child.ring)
            self._on_attached(child)
        elif isinstance(message, Attached):
            self._map_counters(child, fds[:1])  # the counters' fd first, then a writer's commit counter
            self._emit(child, message, fds[1:])
            self._on_attached(child)
        elif isinstance(message, ChildError):
            child.error_type, child.traceback_text = message.type_name, message.traceback
        elif isinstance(message, PassEnd):
            self.inbox.pass_ended(message.number)
        elif isinstance(message, MixShare):
            self._mix_shares.add(child.index)
        else:
            self._emit(child, message, fds)

    def _emit(self, child: ChildProcess, message: object, fds: list[int]) -> None:
        handler = self._handlers.get(type(message))
        if handler is not None:
            handler(child, message, fds)
            return
        for fd in fds:
            os.close(fd)
        if not isinstance(message, Attached):
            log.warning("unexpected %s from %s %d", type(message).__name__, child.role, child.index)

    def _map_counters(self, child: ChildProcess, fds: list[int]) -> None:
        """Map the child's counters page (NOTE [ Child counters ] in shm/counters.py); the fd is closed either way."""
        if not fds:
            return
        for extra in fds[1:]:
            os.close(extra)
        try:
            counters = ChildCounters(fds[0])
        except BaseException:
            os.close(fds[0])
            raise
        counters.memory.close_fd()  # the mapping keeps the page
        child.counters = counters

    def _on_zygote_event(self, event: ZygoteEvent) -> None:
        if isinstance(event, Spawned):
            for child in self.children:
                if child.seq == event.seq and child.pid is None:
                    child.pid = event.pid
                    child.proc_id = proc_name(self.config.global_rank, child.role, child.index, child.pid)
        else:
            for child in self.children:
                if child.pid == event.pid and child.alive:
                    self._on_exit(child, event.exitcode)

    def _on_exit(self, child: ChildProcess, exitcode: int) -> None:
        self._drain(child)
        if child.role == "reader" and not self._closed:
            self._recover_batches(child)
        child.exitcode = exitcode
        child.channel.close()
        self.inbox.child_exited()
        if child.pid is not None:
            remove_socket(attach_socket_path(child.pid, self.runtime_path))
        if self._closed:
            return
        inexact: GigashuffleError | None = None
        if child.role == "writer" and self.stateful:
            # Before the repair: its successor starts after its last commit (NOTE [ Respawned writers ]).
            lanes = writer_lanes(self.config.local_rank, child.index)
            for handler in self._death_handlers:
                inexact = inexact or handler(child.index, lanes, self._lane_values)
        self._reclaim(child)
        error = WorkerDied(child.role, child.index, child.pid or -1, exitcode, child.traceback_text,
                           self.config.queue_name)  # fmt: skip
        if child.superseded or child.error_type == "QueueStateLostError":
            saw_newer = child.error_type == "QueueStateLostError" and child.generation == self.session.generation
            if self.session.lost is None and not saw_newer:
                # Its session is gone and we are in the new one (or we killed it in this one): start it now.
                child.superseded = False
                self.children.append(self._spawn(child.role, child.index, child.restarts))
            else:
                # It saw a newer session before (or as) our heartbeat did: the rejoin starts it again.
                child.superseded = True
                if self.session.lost is None:
                    self.session.lost = QueueStateLostError(f"{child.role} {child.index} found: {error}")
        elif inexact is not None and self.config.delivers_once:
            if self.failure is None:
                self.failure = inexact
        elif child.restarts < self._restart_budget(child) and not child.traceback_text:
            log.warning("%s; restarting it (%d of %d)", error, child.restarts + 1, self.config.max_restarts)
            self._restarts += 1
            self.children.append(self._spawn(child.role, child.index, child.restarts + 1))
        elif self.failure is None:
            self.failure = error

    def _recover_batches(self, child: ChildProcess) -> None:
        """Batches the dead reader released and never announced (NOTE [ Lanes ] in shm/lanes.py): its channel is
        drained, so every batch it announced is in the inbox and only these still carry a number."""
        lane = reader_lane(self.config.local_rank, child.index)
        if child.ring is None or lane == NO_LANE or not self.config.delivers_once:
            return
        values = self._lane_values((lane,))
        if values is not None and (found := self.inbox.recover(child, values[0])):
            log.info("reader %d died between releasing and announcing %d batches: delivering them", child.index, found)

    def _lane_values(self, lanes: tuple[int, ...]) -> tuple[int, ...] | None:
        """Lane values once any op a dead child was inside is rolled forward; None if the table is not mapped."""
        table = self.table()
        if table is None:
            log.warning("the node's slot table is not mapped: a dead child's last commit or release is not known")
            return None
        return table.lane_values(lanes, wait_s=_LANE_WAIT_S)

    def _on_attached(self, child: ChildProcess) -> None:
        child.attached = True
        self.table()  # map it now: its verified metadata is what a rejoin publishes again

    def _rejoin(self, reason: BaseException) -> None:
        """Carry on under a new session with the same buffer and children (NOTE [ Rejoining ] in trainer/rejoin.py)."""
        self.failure = rejoin.join_again(self.config, self.session, self.node_table, reason)
        if self.failure is None:
            self._learn_pids()
            rejoin.resume_children(self.children, self.session.generation, self.zygote, self._spawn)

    def _learn_pids(self) -> None:
        try:
            self._handle_zygote_events()  # learn the pids of children spawned since the last pump
        except GigashuffleError as exc:
            log.warning("%s", exc)

    def _stop_children(self) -> bool:
        """Kill every child (through the zygote) and forget them; batches already announced stay deliverable.
        True when every child is known dead (reaped by the zygote)."""
        self._learn_pids()
        reaped = self.zygote.close()
        for child in self.children:
            if child.pid is not None:
                remove_socket(attach_socket_path(child.pid, self.runtime_path))
            if child.alive:
                child.exitcode = -9
                child.channel.close()
        return reaped

    def _restart_budget(self, child: ChildProcess) -> int:
        # A fill_once reader dies mid-pass with state the trainer cannot replay; fail instead of restarting it.
        if self.config.fill_once and child.role == "reader":
            return 0
        return self.config.max_restarts

    # -- the slot table --------------------------------------------------------------------------------------
    def table(self) -> SlotTable | None:
        """The node's slot table, mapped on first use; None while no buffer is published or none is served."""
        return self.node_table.get()

    def _reclaim(self, child: ChildProcess) -> None:
        """Repair a dead child's slots in the table, then drop it from the process registry."""
        if child.pid is None:
            return
        self.node_table.repair_reaped(child.proc_id)
        try:
            if child.proc_id:
                self.session.store.unregister(child.proc_id)
        except GigashuffleError as exc:
            log.warning("could not reclaim the slots of %s: %s", child.proc_id, exc)

    # -- the writers and readers ----------------------------------------------------------------------------
    def writers(self) -> list[ChildProcess]:
        return [c for c in self.children if c.role == "writer" and c.alive]

    def readers(self) -> list[ChildProcess]:
        return [c for c in self.children if c.role == "reader" and c.alive]

    def say_go(self, send: bool = True) -> None:
        """Let writers that hold before reading go on (NOTE [ Restore before reading ]); later ones start going.
        ``send=False``: only later ones (a ``LoadState`` on its way says go to the live ones)."""
        if not self._specs.go:
            self._specs.go = True
            if send:
                self.send_to_writers(Go())

    def set_context(self, context: Any) -> None:
        """``attach_training_context``: every writer gets ``context`` now, and writers started later in their spec."""
        self._specs.context = context
        self.send_to_writers(SetContext(context))

    def set_epoch(self, epoch: int) -> None:
        """``set_epoch``: every writer calls ``dataset.set_epoch(epoch)`` now, and writers started later too."""
        self._specs.epoch = epoch
        self.send_to_writers(SetEpoch(epoch))

    def send_to_writers(self, message: ToChild) -> None:
        payload = dumps_by_value(message)  # a context object may be an instance of a class from __main__
        for child in self.writers():
            try:
                child.channel.send_bytes(payload)
            except OSError as exc:
                log.debug("writer %d did not take %s: %s", child.index, type(message).__name__, exc)

    # -- teardown --------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every child and release every resource (NOTE [ Shutdown ] in trainer/teardown.py); safe to call
        twice and from a finalizer. A Ctrl-C meanwhile waits for the end of it (NOTE [ Ctrl-C ]): a teardown stopped
        half way leaves processes and Redis keys."""
        with critical(deliver=False):
            self._shutdown()

    def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_children()
        for child in self.children:
            child.ring = None
            if child.counters is not None:
                child.counters.close()
                child.counters = None
        self.inbox.clear()
        self.node_table.repair_at_close()
        self.node_table.close()
        for handler in self._close_handlers:
            handler()
        self.link.close()
        log.debug("loader of %s closed (pid %d)", self.config.queue_name, os.getpid())
