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
What each message does is ``trainer/childmessages.py``; what a death does, ``trainer/deaths.py``.

The supervisor knows children, not checkpoints: what the checkpoint package needs of it it gets through events
(``on(message type)``, ``on_writer_death``, ``on_close``), one ``send``, and the ``WriterStarts`` it is given, which
says where each writer starts and whether children started now start held (a cut is on).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from gigashuffle.config import DataloaderConfig
from gigashuffle.control.link import ControlLink
from gigashuffle.errors import GigashuffleError
from gigashuffle.procs.childspec import proc_name
from gigashuffle.procs.interrupts import critical
from gigashuffle.procs.messages import Spawned, ToChild, ZygoteEvent
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.shm.slotqueue import RECHECK_S
from gigashuffle.shm.slottable import SlotTable
from gigashuffle.trainer import forks, rejoin
from gigashuffle.trainer.childmessages import ChildMessages, drain
from gigashuffle.trainer.children import Children
from gigashuffle.trainer.childspecs import ChildSpecs, WriterStarts
from gigashuffle.trainer.deaths import DeathHandler, Deaths
from gigashuffle.trainer.inbox import Inbox
from gigashuffle.trainer.nodetable import TableView
from gigashuffle.trainer.pinning import Placement

log = logging.getLogger(__name__)

_PUMP_S = 0.25

M = TypeVar("M")


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
        self._close_handlers: list[Callable[[], None]] = []
        # The trainer-side state (the inbox, the children, the channels) has one thread at a time: pump() and
        # Batches.next_batch() hold this for their whole run (see pump()).
        self.turn = threading.RLock()
        self.pumps = 0  # pumps done: a message sent before one began was read by it if it had come
        self.pumped_at = float("-inf")  # when the last pump ended: NOTE [ Batches between pumps ] in batches.py
        self._quiet_pumps = 0  # pumps in a row that found nothing: each waits twice as long for a missed doorbell
        self.failure: BaseException | None = None
        self._closed = False
        self.forked_from: int | None = None  # in a fork's copy, the pid of the trainer it was copied from
        # The rank that copies the buffer at a checkpoint maps it with the table (NOTE [ Checkpoint cut ], in
        # the mode of DataloaderConfig.delivers_once); a dataset without state is never checkpointed.
        copies = stateful and config.local_rank == 0 and config.delivers_once
        self.node_table = TableView(config, session, self.runtime_path, link.url, map_rows=copies)
        session.counts = self.node_table.counts
        self._messages = ChildMessages(config, self.inbox, placement.adopt, self.node_table)
        self._children = Children(ChildSpecs(config, dataset, link, runtime_dir, stateful, starts), self.children)
        self._deaths = Deaths(config, session, self.node_table, self.inbox, self.runtime_path, stateful, self.children,
                              self._children.spawn)  # fmt: skip
        self.seed = self._children.specs.seed
        self.zygote = self._children.zygote
        forks.register(self)
        self._children.start()

    # -- read-only figures ----------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def go(self) -> bool:
        """Whether writers read their datasets (NOTE [ Restore before reading ] in procs/resume.py)."""
        return self._children.specs.go

    @property
    def restarts(self) -> int:
        """Children started again after a death (for metrics(); rejoins are not restarts)."""
        return self._deaths.restarts

    def late_writers(self) -> list[int]:
        """The live writers that have not written their share of the node's first mix (NOTE [ First mix ])."""
        return sorted(c.index for c in self.writers() if c.index not in self._messages.mix_shares)

    # -- events for the checkpoint package (checkpoint/checkpoints.py) ----------------------------------------
    def on(self, kind: type[M], handler: Callable[[ChildProcess, M, list[int]], None]) -> None:
        """Call ``handler(child, message, fds)`` for every message of type ``kind`` (one handler per type)."""
        self._messages.handlers[kind] = handler

    def on_writer_death(self, handler: DeathHandler) -> None:
        """Call ``handler`` when a writer of a stateful dataset dies, before its slots are repaired."""
        self._deaths.handlers.append(handler)

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

        One thread at a time, and never beside a thread inside ``next()``: a loader used from two threads (a training
        loop, and a monitor calling ``child_pids()``, which pumps until a respawned child's pid is known) read one
        channel from both (one thread took a message's header and the other its payload as the next header: a 60 s
        hang right after a respawn in the chaos tests), and, with only the pump locked, flushed one reader's unsent
        ring slots from both (a KeyError in ``DroppedBatches.due``, or a slot appended to a list the other thread
        had just sent: lost for good, and the reader starved). ``self.turn`` covers both."""
        with self.turn:
            self._pump(timeout)
            self.pumps += 1
            self.pumped_at = time.monotonic()

    def _pump(self, timeout: float) -> None:
        self.raise_if_failed()
        inbox = self.inbox
        # Give the dropped batches' slots back, ask the readers for a doorbell, then look at their rings again: a
        # batch announced before a reader saw the request rang nothing. A missed doorbell costs at most the select's
        # wait (NOTE [ Slot queues ]): RECHECK_S at first, doubling while the pumps find nothing, so that a trainer
        # left waiting wakes rarely. One section for both (each swaps SIGINT's handler twice).
        try:
            with critical():
                inbox.give_back_dropped()
                asked, taken = inbox.expect_announcements()
            if taken:
                timeout = 0
            elif asked:
                timeout = min(timeout, RECHECK_S * (1 << min(self._quiet_pumps, 5)))
            live = [c for c in self.children if c.alive]
            channels = [self.zygote.channel, *(c.channel for c in live)]
            readable, _, _ = select.select(channels, [], [], timeout)
        finally:
            inbox.stop_expecting()
        self._quiet_pumps = 0 if readable or taken else self._quiet_pumps + 1
        for child in live:
            if child.channel in readable:
                self._drain(child)
        # Only when the zygote said something: each section swaps SIGINT's handler twice (two sigaction calls), and
        # events() reads nothing that select() did not see (the channel keeps no buffer of its own). A message that
        # came after the select is read by the next pump, as one after the poll always was.
        if self.zygote.channel in readable:
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
        drain(child, self.inbox, self._messages.on_message)

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
        self._drain(child)  # its last messages first: a ChildError's text, a reader's last batches
        failure = self._deaths.on_exit(child, exitcode, self._closed)
        if failure is not None and self.failure is None:
            self.failure = failure

    def _rejoin(self, reason: BaseException) -> None:
        """Carry on under a new session with the same buffer and children (NOTE [ Rejoining ] in trainer/rejoin.py)."""
        self.failure = rejoin.join_again(self.config, self.session, self.node_table, reason)
        if self.failure is None:
            self._learn_pids()
            rejoin.resume_children(self.children, self.session.generation, self.zygote, self._children.spawn)

    def _learn_pids(self) -> None:
        try:
            self._handle_zygote_events()  # learn the pids of children spawned since the last pump
        except GigashuffleError as exc:
            log.warning("%s", exc)

    def _stop_children(self) -> bool:
        """Kill every child and forget them; batches already announced stay deliverable. True when every child is
        known dead (reaped by the zygote)."""
        self._learn_pids()
        return self._children.stop(self.runtime_path)

    # -- the slot table --------------------------------------------------------------------------------------
    def table(self) -> SlotTable | None:
        """The node's slot table, mapped on first use; None while no buffer is published or none is served."""
        return self.node_table.get()

    # -- the writers and readers (trainer/children.py) -----------------------------------------------------------
    def writers(self) -> list[ChildProcess]:
        return self._children.writers()

    def readers(self) -> list[ChildProcess]:
        return self._children.readers()

    def say_go(self, send: bool = True) -> None:
        self._children.say_go(send)

    @property
    def reading_began(self) -> bool:
        return self._children.reading_began

    def set_context(self, context: Any) -> None:
        self._children.set_context(context)

    def set_epoch(self, epoch: int) -> None:
        self._children.set_epoch(epoch)

    def send_to_writers(self, message: ToChild) -> None:
        self._children.send_to_writers(message)

    # -- teardown --------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every child and release every resource (NOTE [ Shutdown ] in trainer/teardown.py); safe to call
        twice and from a finalizer. A Ctrl-C meanwhile waits for the end of it (NOTE [ Ctrl-C ]): a teardown stopped
        half way leaves processes and Redis keys."""
        with critical(deliver=False):
            self._shutdown()

    def forget_in_fork(self, parent: int) -> None:
        """In a fork's child: closed here, with nothing shared touched (NOTE [ Forks of the trainer ])."""
        self.forked_from, self._closed = parent, True
        self.node_table.close(in_fork=True)

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
