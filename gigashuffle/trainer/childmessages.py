"""What each message from a child does on the trainer's side (NOTE [ Supervision ] in trainer/supervisor.py): a
reader's batch and its ring, a child's attach with its counters page, a child's error text, the end of a pass, a
writer's share of the first mix; every other message goes to the handler the checkpoint package registered for its
type (``Supervisor.on``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from gigashuffle.config import DataloaderConfig
from gigashuffle.procs.channel import ChannelClosed
from gigashuffle.procs.interrupts import critical
from gigashuffle.procs.messages import Attached, BatchReady, BufferOffer, ChildError, MixShare, PassEnd, RingReady
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import BatchRing, SharedMemory
from gigashuffle.shm.counters import ChildCounters
from gigashuffle.trainer.inbox import Inbox
from gigashuffle.trainer.nodetable import TableView

log = logging.getLogger(__name__)

# A message handler: the child, its message, the fds that came with it (the handler owns them).
Handler = Callable[[ChildProcess, Any, list[int]], None]


class ChildMessages:
    """Applies the children's messages, read by the supervisor's pump one at a time."""

    def __init__(
        self, config: DataloaderConfig, inbox: Inbox, on_ring: Callable[[BatchRing], None], node_table: TableView
    ) -> None:
        self.config = config
        self.inbox = inbox
        self._on_ring = on_ring  # a reader's ring arrived: rings are registered with CUDA then, not per batch
        self._node_table = node_table
        self.handlers: dict[type, Handler] = {}  # Supervisor.on(): the checkpoint package's messages
        self.mix_shares: set[int] = set()  # writers that sent MixShare (NOTE [ First mix ] in procs/firstmix.py)

    def on_message(self, child: ChildProcess, message: object, fds: list[int]) -> None:
        if isinstance(message, BatchReady):
            return  # a doorbell: the supervisor took the announcements before it read this (NOTE [ Slot queues ])
        if isinstance(message, RingReady):
            memory = SharedMemory(message.nbytes, fds[0])
            memory.close_fd()
            layout = Layout.from_json(message.layout_json)
            child.ring = BatchRing(layout, self.config.bs, message.depth, memory)
            map_counters(child, fds[1:])
            self._on_ring(child.ring)
            self._on_attached(child)
        elif isinstance(message, BufferOffer):  # NOTE [ The trainer holds the buffer ] in trainer/nodetable.py
            self._node_table.offer(message.owner, fds[0], fds[1])
        elif isinstance(message, Attached):
            map_counters(child, fds[:1])  # the counters' fd first, then a writer's commit counter
            self._emit(child, message, fds[1:])
            self._on_attached(child)
        elif isinstance(message, ChildError):
            child.error_type, child.traceback_text = message.type_name, message.traceback
        elif isinstance(message, PassEnd):
            self.inbox.pass_ended(message.number)
        elif isinstance(message, MixShare):
            self.mix_shares.add(child.index)
        else:
            self._emit(child, message, fds)

    def _emit(self, child: ChildProcess, message: object, fds: list[int]) -> None:
        handler = self.handlers.get(type(message))
        if handler is not None:
            handler(child, message, fds)
            return
        for fd in fds:
            os.close(fd)
        if not isinstance(message, Attached):
            log.warning("unexpected %s from %s %d", type(message).__name__, child.role, child.index)

    def _on_attached(self, child: ChildProcess) -> None:
        child.attached = True
        self._node_table.get()  # map it now: its verified metadata is what a rejoin publishes again


def map_counters(child: ChildProcess, fds: list[int]) -> None:
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


def drain(child: ChildProcess, inbox: Inbox, on_message: Handler) -> None:
    """Apply every message ``child`` sent so far, each after the batches it announced before sending it (NOTE [ Slot
    queues ] in shm/slotqueue.py): a cut's listing after a ``Paused``, or a pass's end after a ``PassEnd``, sees
    every batch announced before it."""
    try:
        # One section for them all (a message read by half leaves the stream out of frame: NOTE [ Ctrl-C ]); one per
        # message swapped SIGINT's handler twice more per pump, for the look that finds the channel empty.
        with critical():
            while True:
                inbox.take_announced(child)
                if not child.channel.poll(0):
                    return
                message, fds = child.channel.recv()
                on_message(child, message, fds)
    except (ChannelClosed, ConnectionError):
        return  # the zygote reports the exit status; the error text, if any, was read above
