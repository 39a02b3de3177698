"""The trainer's supervisor: spawns the children, reads their messages, notices deaths, and tears down.

NOTE [ Supervision ]
The trainer never blocks on one thing: every wait is a ``select`` over the zygote's channel and every child's
channel with a timeout of at most ``_PUMP_S``, so a child's death (reported by the zygote with its exit status)
or a lost Redis session (once the heartbeat saw it: NOTE [ Heartbeat ]) is seen within about a second even while
the trainer waits for a batch. A child that raised sends a ``ChildError`` (type and traceback) before exiting;
the trainer raises that text in a ``WorkerDied``. A dead child's slots are repaired in the slot table at once
(when the trainer has mapped it; else the other children's once-a-second repair finds the dead pid), and with
``max_restarts`` left it is spawned again.
When the session itself is lost, the trainer rejoins (NOTE [ Rejoining ]). ``shutdown()`` is idempotent and is
also the loader's ``weakref.finalize`` callback, so it must not refer to the loader object.

NOTE [ Rejoining ]
Redis may forget or contradict the node session: restarted without persistence, flushed, restored from an older
snapshot, failed over to a replica. The heartbeat notices (a claim that is gone within one beat, a changed
generation or ``run_id`` within ``VERIFY_EVERY`` beats: NOTE [ Heartbeat ]), and so does a child whose
generation-checked call is refused. None of that touches the rows:
the buffer and its slot table live in the children's shared memory. So the trainer
  1. joins again: the first rank of the node back starts a new generation, the others join it;
  2. publishes the buffer's metadata again under it, from the verified copy it kept when it mapped the slot
     table (first publication wins; every rank's copy describes the same buffer). It does this before any child
     starts under the new generation, so a new writer attaches to the node's buffer instead of making another;
  3. sends ``Rejoin(generation)`` to every child that has the buffer mapped (``Attached``/``RingReady`` seen):
     it registers again (its attach socket) and quotes the new generation; the dummy writer publishes its row
     again. Such a child never stopped moving rows: no child calls Redis in the steady state;
  4. kills, through the zygote, every child still starting (it holds no slots and would quote the old
     generation) and starts it again. A child that died of a refused generation is started again too. Neither
     counts against ``max_restarts``: nothing failed.
No row is lost, delivered twice or torn, since the slot table never left shared memory. A rank whose trainer
never mapped the slot table (no child of it had attached yet) cannot republish the metadata, and a new writer may
start before the ranks that can have: finding no metadata, it looks for the node's buffer in the runtime
directory and publishes that one again (NOTE [ A buffer Redis forgot ] in procs/forgottenbuffer.py), so a node keeps one
buffer.
Only a Redis that stays unreachable past ``redis_timeout_s`` fails the loader (``QueueStateLostError``).

NOTE [ Shutdown ]
The teardown order, per actor, written once; each step assumes the ones before it are done.
* Trainer (``loader.close()``, ``__exit__``, or the loader's ``weakref.finalize`` at garbage collection or
  interpreter exit; all run ``_shutdown`` in loader.py once):
  1. the placement waits for copies still reading the reader rings (pinned or on a GPU), then unregisters the
     rings: a ring must stay mapped while a DMA reads it;
  2. ``Supervisor.shutdown`` (idempotent): the zygote kills every child and reaps them (``Zygote.close``); the
     children's attach sockets go; then the slot table is repaired for the children known reaped (other ranks'
     children go on and need the slots ours held) and only then unmapped: repair needs the table and its lock fd;
  3. the control link closes last (``ControlLink.close``): leave the node session (the last rank deletes the
     queue's keys), close the client, release the embedded server (its last user shuts it down).
  A half-built loader undoes the same steps for what it opened: ``ControlLink.open`` its own, the Supervisor's
  constructor the zygote.
* Zygote: when its channel closes (the trainer closed it or died), it SIGKILLs its children, reaps them, removes
  their attach sockets and exits without interpreter teardown (``procs/zygote.py``).
* Child: dies with the zygote (PR_SET_PDEATHSIG); a child that exits on its own closes its attach server, its
  maps and its Redis client (``ChildEnv.close``). It never repairs for itself: a dead child's slots are the next
  lock holder's to repair (NOTE [ Slot table ] in shm/slottable.py).
* Embedded server: stopped by the last live user's release; one whose starter died is found dead by the next
  user and its socket file removed.
"""

from __future__ import annotations

import logging
import os
import select
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gigashuffle.config import DataloaderConfig
from gigashuffle.control.link import ControlLink
from gigashuffle.errors import GigashuffleError, NodeLockBusy, QueueStateLostError, WorkerDied
from gigashuffle.host.rundir import attach_socket_path, remove_socket
from gigashuffle.procs.channel import ChannelClosed
from gigashuffle.procs.childenv import NO_CONTEXT, ChildSpec, proc_name
from gigashuffle.procs.interrupts import critical
from gigashuffle.procs.messages import (
    Attached,
    BatchReady,
    ChildError,
    DatasetState,
    FreeSlot,
    Go,
    MixShare,
    PassEnd,
    Pause,
    Paused,
    Progress,
    Rejoin,
    RingReady,
    Role,
    Spawned,
    ToChild,
    ZygoteEvent,
)
from gigashuffle.procs.pickling import dumps_by_value
from gigashuffle.procs.seeds import base_seed
from gigashuffle.procs.zygoteclient import ChildProcess, Zygote
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import BatchRing, SharedMemory
from gigashuffle.shm.counters import ChildCounters
from gigashuffle.shm.slottable import SlotTable
from gigashuffle.trainer.dropped import DroppedBatches
from gigashuffle.trainer.nodetable import TableView
from gigashuffle.trainer.resumepoints import ResumePoints

log = logging.getLogger(__name__)

_PUMP_S = 0.25
# How long the trainer waits for the node lock to return a dead child's slots: children's housekeeping does it too.
_REPAIR_WAIT_S = 1.0


class Supervisor:
    def __init__(
        self,
        config: DataloaderConfig,
        dataset: Any,
        link: ControlLink,
        runtime_dir: str,
        stateful: bool = False,
    ) -> None:
        self.config = config
        self.dataset = dataset
        self.link = link  # closed last by shutdown(): NOTE [ Shutdown ]
        self.client = link.client
        self.redis_url = link.url
        session = self.session = link.session
        # A stateful dataset's writers track their commits and hold before reading until ``say_go()`` (NOTE
        # [ Respawned writers ] and [ Restore before reading ] in procs/resume.py); a feed-only rank never asks.
        self.stateful = stateful
        self.go = not stateful or config.num_readers == 0
        self.resume = ResumePoints(config.num_writers)
        self.runtime_dir = runtime_dir
        self.runtime_path = Path(runtime_dir)
        self.children: list[ChildProcess] = []
        self.ready: deque[tuple[ChildProcess, int]] = deque()
        self.dropped = DroppedBatches()
        self.on_ring: Callable[[BatchRing], None] = _no_placement  # a reader's ring arrived (the loader pins it)
        self.states: dict[int, DatasetState] = {}  # writer index -> its answer to the last StateRequest
        self.paused: set[int] = set()  # spawn seqs of readers that answered Pause (NOTE [ Checkpoint cut ])
        self.cutting = False  # a checkpoint's cut is on: children started now start paused
        self.last_cut_s = 0.0  # how long the last cut paused this rank's writers and readers (for the bench)
        self.cuts = 0  # state_dict() calls so far: the node barrier's cut number (NOTE [ Node cut ])
        self.passes_ended: set[int] = set()  # fill_once passes whose reader sent PassEnd
        self.mix_shares: set[int] = set()  # writers that sent MixShare (NOTE [ First mix ] in procs/firstmix.py)
        self.failure: BaseException | None = None
        self.closed = False
        self._dead = 0  # children that exited and are still listed (see _forget_dead)
        self.restarts = 0  # children started again after a death (for metrics(); rejoins are not restarts)
        self.context: Any = NO_CONTEXT  # what attach_training_context() gave last; respawned writers get it too
        self.epoch: int | None = None  # the last set_epoch() the dataset took, for writers started later
        self.node_table = TableView(config, session, self.runtime_path)
        session.counts = self.node_table.counts
        self.seed, origin = base_seed(config, session.generation, os.environ)
        log.info(
            "queue %r rank %d: seed %d (from %s); DataloaderConfig(seed=%d) repeats the writers' streams",
            config.queue_name, config.global_rank, self.seed, origin, self.seed,
        )  # fmt: skip
        self._starts: dict[tuple[str, int], int] = {}
        self._zygote_title = f"gigashuffle zygote {config.queue_name} rank={config.global_rank}"
        self.zygote = Zygote(self._zygote_title)
        try:
            self._spawn_all()
        except BaseException:
            # E.g. an unpicklable dataset: the loader gets no Supervisor to shut down, so stop the zygote now.
            self.zygote.close()
            for child in self.children:
                child.channel.close()
            raise

    def _spawn_all(self) -> None:
        counts: tuple[tuple[Role, int], ...] = (
            ("writer", self.config.num_writers),
            ("reader", self.config.num_readers),
        )
        for role, count in counts:
            for index in range(count):
                self.children.append(self._spawn(role, index, restarts=0))

    # -- spawning --------------------------------------------------------------------------------------------
    def _spec(self, role: Role, index: int) -> bytes:
        state, skip, serial, saved = self.resume.start_of(index) if role == "writer" else (None, 0, 0, ("", ()))
        start = self._starts.get((role, index), 0)
        self._starts[(role, index)] = start + 1
        spec = ChildSpec(
            role=role,
            index=index,
            config=self.config,
            redis_url=self.redis_url,
            generation=self.session.generation,
            runtime_dir=self.runtime_dir,
            dataset=self.dataset if role == "writer" else None,
            context=self.context,
            dataset_state=state,
            seed=self.seed,
            start=start,
            stateful=self.stateful,
            skip=skip,
            serial=serial,
            go=self.go and not self.cutting,
            saved_rows=saved,
            epoch=self.epoch if role == "writer" else None,
        )
        try:
            return dumps_by_value(spec)
        except Exception as exc:
            raise TypeError(
                f"the dataset {type(self.dataset).__name__} (or the training context) cannot be pickled for "
                f"the writer processes: {exc}; keep open files, sockets, locks and threads out of it until "
                "__iter__ (open them there)"
            ) from exc

    def _spawn(self, role: Role, index: int, restarts: int) -> ChildProcess:
        cfg = self.config
        title = f"gigashuffle {role} {cfg.queue_name} rank={cfg.global_rank} proc={index}"
        seq, channel = self.zygote.spawn(self._spec(role, index), title)
        if role == "reader" and self.cutting:
            channel.send(Pause())  # read before its first draw
        return ChildProcess(role, index, seq, channel, restarts, generation=self.session.generation)

    # -- the message pump ------------------------------------------------------------------------------------
    def pump(self, timeout: float = _PUMP_S) -> None:
        """Handle whatever the zygote and the children sent, waiting up to ``timeout`` for the first message."""
        self.raise_if_failed()
        self.flush_frees()
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

    def _forget_dead(self) -> None:
        """Drop exited children once nothing refers to them: no batch of theirs waits or is held, and none is to
        be started again. A week of restarts must not keep every dead reader's ring mapped in the trainer."""
        waiting = {id(child) for child, _k in self.ready}
        kept: list[ChildProcess] = []
        for child in self.children:
            if child.alive or child.superseded or child.held > 0 or id(child) in waiting:
                kept.append(child)
            else:
                if child.ring is not None:
                    child.ring.close()  # views the caller still holds keep their pages mapped
                    child.ring = None
                if child.counters is not None:
                    child.counters.close()
                    child.counters = None
        self.children = kept
        self._dead = sum(not child.alive for child in kept)

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
            self.ready.extend((child, k) for k in message.ks)
        elif isinstance(message, RingReady):
            memory = SharedMemory(message.nbytes, fds[0])
            memory.close_fd()
            layout = Layout.from_json(message.layout_json)
            child.ring = BatchRing(layout, self.config.bs, message.depth, memory)
            self._map_counters(child, fds[1:])
            self.on_ring(child.ring)
            self._on_attached(child)
        elif isinstance(message, Attached):
            self._map_counters(child, fds[:1])  # the counters' fd first, then a writer's commit counter
            if child.role == "writer":
                self.resume.on_attached(child.index, fds[1:])
            self._on_attached(child)
        elif isinstance(message, Progress):
            self.resume.on_report(child.index, message)
        elif isinstance(message, ChildError):
            child.error_type, child.traceback_text = message.type_name, message.traceback
        elif isinstance(message, DatasetState):
            self.states[message.index] = message
        elif isinstance(message, Paused):
            self.paused.add(child.seq)
        elif isinstance(message, PassEnd):
            self.passes_ended.add(message.number)
        elif isinstance(message, MixShare):
            self.mix_shares.add(child.index)
        else:
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
        child.exitcode = exitcode
        child.channel.close()
        self._dead += 1
        if child.pid is not None:
            remove_socket(attach_socket_path(child.pid, self.runtime_path))
        if self.closed:
            return
        if child.role == "writer" and self.stateful:
            self.resume.on_death(child.index)  # before the repair: its successor starts after its last commit
        self._reclaim(child)
        error = WorkerDied(child.role, child.index, child.pid or -1, exitcode, child.traceback_text,
                           self.config.queue_name)  # fmt: skip
        if child.superseded or child.error_type == "QueueStateLostError":
            if child.generation != self.session.generation and self.session.lost is None:
                child.superseded = False  # its session is gone and we are in the new one: start it now
                self.children.append(self._spawn(child.role, child.index, child.restarts))
            else:
                # It saw a newer session before (or as) our heartbeat did: the rejoin starts it again.
                child.superseded = True
                if self.session.lost is None:
                    self.session.lost = QueueStateLostError(f"{child.role} {child.index} found: {error}")
        elif child.restarts < self._restart_budget(child) and not child.traceback_text:
            log.warning("%s; restarting it (%d of %d)", error, child.restarts + 1, self.config.max_restarts)
            self.restarts += 1
            self.children.append(self._spawn(child.role, child.index, child.restarts + 1))
        elif self.failure is None:
            self.failure = error

    def _on_attached(self, child: ChildProcess) -> None:
        child.attached = True
        self.table()  # map it now: its verified metadata is what a rejoin publishes again

    def _rejoin(self, reason: BaseException) -> None:
        """Carry on under a new session with the same buffer and children (NOTE [ Rejoining ])."""
        if isinstance(reason, QueueStateLostError):
            log.warning(
                "queue %r: %s; rejoining with the buffer and processes as they are",
                self.config.queue_name, str(reason).splitlines()[0],
            )  # fmt: skip
            try:
                self.session.rejoin()
                self.node_table.republish()
            except GigashuffleError as exc:
                reason = exc
            else:
                self._resume_children()
                return
        self.failure = QueueStateLostError(
            f"queue {self.config.queue_name!r}: {reason}. Redis stayed unreachable past redis_timeout_s="
            f"{self.config.redis_timeout_s}, so the node session could not be joined again; recreate the loader."
        )

    def _resume_children(self) -> None:
        generation = self.session.generation
        self._learn_pids()
        for child in list(self.children):
            if child.alive and child.attached:
                child.generation = generation
                try:
                    child.channel.send(Rejoin(generation))
                except OSError as exc:
                    log.debug("%s %d did not take Rejoin: %s", child.role, child.index, exc)
            elif child.alive and not child.superseded:
                child.superseded = True
                self.zygote.kill(child.seq)
            elif not child.alive and child.superseded:
                child.superseded = False  # died under the old session, before we rejoined: start it now
                self.children.append(self._spawn(child.role, child.index, child.restarts))

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
        try:
            table = self.table()
            if table is not None:
                repaired = table.repair(wait_s=_REPAIR_WAIT_S)  # the zygote reaped it: it no longer exists
                log.debug("repaired %d slots of %s", repaired, child.proc_id)
        except NodeLockBusy as exc:  # NOTE [ A stopped lock holder ] in shm/slottable.py
            log.warning("%s; the slots of %s are returned by the next housekeeping after it", exc, child.proc_id)
        try:
            if child.proc_id:
                self.session.store.unregister(child.proc_id)
        except GigashuffleError as exc:
            log.warning("could not reclaim the slots of %s: %s", child.proc_id, exc)

    # -- batches ---------------------------------------------------------------------------------------------
    def release_later(self, child: ChildProcess, k: int) -> Callable[[], None]:
        return self.dropped.release_later(child, k)

    def flush_frees(self, *, everything: bool = True) -> None:
        """Hand the ring slots of batches the caller dropped back to their readers, one message per reader; without
        ``everything``, only the slots that are due (NOTE [ Batched frees ])."""
        with critical():  # a slot drained from the queue and not yet sent is in no list (NOTE [ Ctrl-C ])
            for child, ks in self.dropped.due(everything=everything):
                self.send_free(child, *ks)
            if self._dead:
                self._forget_dead()

    def send_free(self, child: ChildProcess, *ks: int) -> None:
        if not child.alive:
            return
        try:
            child.channel.send(FreeSlot(ks))
        except OSError:
            log.debug("%s %d is gone; its ring slots %s are not returned", child.role, child.index, ks)

    def writers(self) -> list[ChildProcess]:
        return [c for c in self.children if c.role == "writer" and c.alive]

    def readers(self) -> list[ChildProcess]:
        return [c for c in self.children if c.role == "reader" and c.alive]

    def say_go(self) -> None:
        """Let writers that hold before reading go on (NOTE [ Restore before reading ]); later ones start going."""
        if not self.go:
            self.go = True
            self.send_to_writers(Go())

    def load_states(self, states: list[Any], skips: list[int], saved: tuple[str, tuple[Any, ...]]) -> list[int]:
        """``load_state_dict``: writers started from now on start from these (writer 0 puts ``saved``, a
        checkpoint's rows, back first); returns the states' serials."""
        self.go = True
        return self.resume.load(states, skips, saved)

    def send_to_writers(self, message: ToChild) -> None:
        payload = dumps_by_value(message)  # a context object may be an instance of a class from __main__
        for child in self.writers():
            try:
                child.channel.send_bytes(payload)
            except OSError as exc:
                log.debug("writer %d did not take %s: %s", child.index, type(message).__name__, exc)

    # -- teardown --------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every child and release every resource (NOTE [ Shutdown ]); safe to call twice and from a finalizer.
        A Ctrl-C meanwhile
        waits for the end of it (NOTE [ Ctrl-C ]): a teardown stopped half way leaves processes and Redis keys."""
        with critical(deliver=False):
            self._shutdown()

    def _shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop_children()
        for child in self.children:
            child.ring = None
            if child.counters is not None:
                child.counters.close()
                child.counters = None
        self.ready.clear()
        self.dropped.clear()
        table = self.node_table.mapped
        if table is not None:  # other ranks' children go on: give them what ours held
            # Repair takes the slots of holders that no longer exist: a child still dying could commit or release
            # slots just repaired (its check of what it holds precedes the lock: NOTE [ Node lock budget ]), so
            # children the zygote did not reap are left to later housekeeping (theirs, or the other ranks').
            try:
                table.repair(wait_s=_REPAIR_WAIT_S)
            except NodeLockBusy as exc:  # their housekeeping returns them once the holder goes on
                log.warning("%s; this rank's slots are left to the other ranks' housekeeping", exc)
        self.node_table.close()
        self.resume.close()
        self.link.close()
        log.debug("loader of %s closed (pid %d)", self.config.queue_name, os.getpid())


def _no_placement(ring: BatchRing) -> None:
    """``on_ring`` until the loader sets its placement's."""
