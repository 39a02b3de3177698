"""The batches a loader yields: an endless (or ``steps_per_epoch``-long) stream, or fill_once passes; the trainer's
wait for them, and their hand-over (the ring slots themselves are the inbox's: NOTE [ A ring slot's walk ] in
trainer/inbox.py).

NOTE [ Batches between pumps ]
A pump is where the trainer learns what else happened: a child's death or error, a lost Redis session, a respawned
child's pid. It costs a ``select`` and a ``critical()`` section or two, which a trainer with batches announced in
the rings need not pay per batch. So ``next()`` with no batch ready takes the readers' announcements from their
rings itself, without a pump, as long as the last pump ended less than ``PUMP_EVERY_S`` ago; after that it pumps,
whatever the rings hold. (Measured alone, this saved nothing visible in the bench: docs/benchmarks.md.) Hence:
  - a trainer that batches keep coming to still pumps every ``PUMP_EVERY_S`` at least: a death, a failure or a lost
    session is seen at most that much later than with a pump per batch (a trainer fed only from the rings, with no
    such bound, never rejoined a failed-over Redis: ``test_redis_faults``);
  - a batch taken here was announced before any message its reader sends after it. Taking it before the pump reads
    an earlier message (a ``Paused``, a ``PassEnd``) only makes an announcement seen earlier, never later, which is
    all the cut and the pass rely on (NOTE [ A ring slot's walk ]); ``one_pass`` takes only through its pumps.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from gigashuffle.config import DataloaderConfig
from gigashuffle.errors import GigashuffleError
from gigashuffle.procs.firstmix import empty_writers, stall_s
from gigashuffle.procs.interrupts import critical
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.schema import INDEX_KEY
from gigashuffle.trainer import forks, pinning, progress, waiting
from gigashuffle.trainer.metrics import MetricsReader
from gigashuffle.trainer.pinning import Batch
from gigashuffle.trainer.supervisor import Supervisor

log = logging.getLogger(__name__)


_SLOW_WARNING_S = 60.0
_STALL_CHECK_S = 0.5  # how often a trainer waiting for its first batch looks for stalled writers and an empty node
# How often the trainer looks at pending ring releases while it waits for a batch (NOTE [ GPU placement ]).
_PENDING_PUMP_S = 0.002
# How long after a pump next() may take batches from the rings without pumping (NOTE [ Batches between pumps ]).
PUMP_EVERY_S = 0.01
_profiling = torch.autograd._profiler_enabled  # type: ignore[attr-defined]  # 0.06 us: a torch profiler records


class Batches:
    """What ``iter(loader)`` walks: the next batch, waiting for it when none is ready, shaped as the config asks."""

    def __init__(
        self, config: DataloaderConfig, sup: Supervisor, placement: pinning.Placement, metrics: MetricsReader
    ) -> None:
        self.config = config
        self._sup = sup
        self._inbox = sup.inbox
        self._placement = placement
        self._metrics = metrics
        # The version of the write each slot held when this trainer last received it: evict() names that write,
        # so a late evict never drops a newer row (-1: never received here, evict whatever the slot holds).
        self.versions = np.full(config.shuffle_size, -1, dtype=np.int64)
        # Filling progress is shown while this rank waits for its first batch, then never again.
        self._progress: progress.FillProgress | None = None
        self._first_batch_seen = False
        # NOTE [ First mix ] in procs/firstmix.py; with first_mix_wait_s=0 no writer waits, so none is late.
        wait = config.first_mix_wait_s
        self._stalls = waiting.StalledWriters(stall_s(config)) if wait else None
        self._stalls_due = 0.0
        self._empty_node = waiting.EmptyNode(config)  # NOTE [ Empty shares ] in procs/chunks.py
        self._empty_writers = empty_writers(sup.session)

    def check_open(self) -> None:
        if self._sup.closed:
            self.check_not_a_fork()  # a fork's copy is closed, and says whose it is
            raise GigashuffleError(f"the loader of queue {self.config.queue_name!r} is closed")
        self._sup.raise_if_failed()

    def check_not_a_fork(self) -> None:
        forks.refuse_a_copy(self.config.queue_name, self._sup.forked_from)

    def stop_progress(self) -> None:
        """At close: a filling bar still shown ends, unreached."""
        if self._progress is not None:
            self._progress.finish(reached=False)
            self._progress = None

    def stream(self) -> Iterator[Any]:
        steps = self.config.steps_per_epoch
        if steps is None:
            while True:
                yield self.next_batch()
        for _ in range(steps):
            yield self.next_batch()

    def one_pass(self) -> Iterator[Any]:
        sup, inbox = self._sup, self._inbox
        with sup.turn:  # one thread at a time in the trainer-side state (Supervisor.pump()), never across a yield
            inbox.abandon_pass(sup.pump)  # the rest of a pass the caller abandoned: the next starts at its first batch
            reader = self.wait_for(lambda: sup.readers()[0] if sup.readers() else None, "the reader to start")
            inbox.open_pass(reader)
        while True:
            with sup.turn:
                while not inbox.ready and not inbox.pass_over:
                    self._show_filling()
                    self._pump()
                self._filled()
                if not inbox.ready:
                    inbox.close_pass()
                    return
                with critical():
                    batch = self.deliver(*inbox.pop())
            yield batch

    def next_batch(self) -> Any:
        if self._sup.forked_from is not None:  # before the turn: a thread of the parent may have held it at the fork
            self.check_not_a_fork()
        with self._sup.turn:  # one thread at a time in the trainer-side state: see Supervisor.pump()
            return self._next_batch()

    def _next_batch(self) -> Any:
        sup, inbox = self._sup, self._inbox
        self.check_open()
        sup.say_go()
        # Give the ring slots of dropped batches back first (those whose copies are done, with pinned rings: NOTE
        # [ A ring slot's walk ] in trainer/inbox.py). With a batch ready, that and the hand-over are one section:
        # only the outermost section swaps SIGINT's handler in and out (NOTE [ Ctrl-C ] in procs/interrupts.py).
        with critical():
            self._placement.poll()
            inbox.give_back_dropped()
            if not inbox.ready and time.monotonic() - sup.pumped_at < PUMP_EVERY_S:
                inbox.take_announcements()  # NOTE [ Batches between pumps ]
            if inbox.ready:
                self._filled()
                return self.deliver(*inbox.pop())
        self._wait_for_batch()
        self._filled()
        # Popped and handed over in one section: a batch popped and never made is a ring slot lost for good. A Ctrl-C
        # meanwhile drops this batch on the way out, and its slot returns like any dropped batch's (NOTE [ Ctrl-C ]).
        with critical():
            return self.deliver(*inbox.pop())

    def _wait_for_batch(self) -> None:
        """Pump until a batch is ready: the trainer's wait, timed for metrics() and named in profiler traces."""
        sup, inbox = self._sup, self._inbox
        waited_since = time.monotonic()
        next_warning = waited_since + _SLOW_WARNING_S
        # Named in traces only while a profiler records: record_function costs ~4.5 us a wait even with none (a
        # quarter of the trainer's extra CPU per batch on tiny against 1d48bcb, issue 34's py-spy --gil profile).
        named = torch.profiler.record_function("gigashuffle.wait") if _profiling() else contextlib.nullcontext()
        try:
            with named:
                while not inbox.ready:
                    self._show_filling()
                    self._pump()
                    if time.monotonic() > next_warning:
                        # Slow data is legitimate (a dataset on a slow filesystem), so this is a warning, not an error.
                        log.warning(
                            "queue %r: no batch for %.0f s; %s%s", self.config.queue_name,
                            time.monotonic() - waited_since, waiting.buffer_state(sup),
                            waiting.stopped_lock_holder(sup),
                        )  # fmt: skip
                        next_warning += _SLOW_WARNING_S
        finally:
            self._metrics.wait_s += time.monotonic() - waited_since

    def _show_filling(self) -> None:
        if self._first_batch_seen:
            return
        if time.monotonic() >= self._stalls_due:
            self._stalls_due = time.monotonic() + _STALL_CHECK_S
            if self._stalls is not None:
                waiting.log_stalled_writers(self._sup, self._stalls)
            self._check_empty_node()
        if self._progress is None:
            cfg = self.config
            self._progress = progress.FillProgress(
                f"queue {cfg.queue_name!r} rank {cfg.global_rank}",
                cfg.min_full_slots,
                functools.partial(waiting.full_slots, self._sup),  # not a method of self: no cycle keeps a loader alive
                bar=cfg.local_rank == 0,  # one bar per node: the ranks of a node share the terminal and the buffer
            )
        self._progress.update()

    def pump_before_rows(self) -> None:
        """A pump of ``get_dummy_batch()``'s wait for the node's first rows, which fails if none can come."""
        if time.monotonic() >= self._stalls_due:
            self._stalls_due = time.monotonic() + _STALL_CHECK_S
            self._check_empty_node()
        self._sup.pump()

    def _check_empty_node(self) -> None:
        published = self._sup.table() is not None
        self._empty_node.check(published, 0 if published else len(self._empty_writers()))

    def _filled(self) -> None:
        if self._first_batch_seen:
            return
        self._first_batch_seen = True
        if self._progress is not None:
            self._progress.finish()
            self._progress = None

    def _pump(self) -> None:
        """Wait a little for messages; with pinned rings, also release the ring slots whose copies are done."""
        placement = self._placement
        if not placement.tracks:
            self._sup.pump()
            return
        # Block on a copy only when no reader has a free ring slot left: otherwise the GPU work queued before it
        # would stall the trainer for nothing.
        placement.poll(wait=self._inbox.starved(self._sup.readers()))
        if placement.pending:
            self._sup.pump(_PENDING_PUMP_S)
        else:
            self._sup.pump()

    def deliver(self, child: ChildProcess, k: int) -> Any:
        self._metrics.batches += 1
        return self.shape(self._deliver_list(child, k))

    def shape(self, batch: Batch) -> Any:
        """The batch as the config asks: without INDEX_KEY, and as the one group's dict (both cost a dict op)."""
        cfg = self.config
        if not cfg.index_key:
            del batch[0][INDEX_KEY]
        if cfg.batch_format == "list":
            return batch
        if len(batch) != 1:
            raise ValueError(
                f"DataloaderConfig.batch_format='dict' is invalid for queue {cfg.queue_name!r}: the dataset's chunks "
                f"have {len(batch)} groups, and a dict holds one; use batch_format='list' or yield one group"
            )
        return batch[0]

    def _deliver_list(self, child: ChildProcess, k: int) -> Batch:
        ring = child.ring
        if ring is None:
            raise AssertionError("a batch arrived before its reader's ring")
        if not self.config.evict_on_read:
            _fields, index = ring.regions(k)
            self.versions[index.numpy()] = ring.versions(k)
        return self._inbox.hand_over(child, k)

    def wait_for(self, probe: Any, what: str) -> Any:
        while (found := probe()) is None:
            self._sup.pump()
        return found
