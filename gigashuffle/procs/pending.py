"""Rows a writer has copied into the buffer and not yet published, and the thread that publishes them in time.

NOTE [ Deferred commits ]
Publishing rows (``writing`` -> ``full``) takes a hold of the node lock, a journaled transition and the traffic of
the slot arrays' cache lines between cores. Paid per chunk, that was about a sixth of a writer's CPU on 64-row
token chunks, so a writer whose next chunk is already reserved leaves the rows it copied pending and publishes
them, reserving the slots of the next few chunks in the same hold, once per ``rows_per_commit`` rows: four
chunks, but never more than a sixteenth of the buffer (small buffers still commit every chunk). Measured with
``gigashuffle bench`` (docs/benchmarks.md): writer CPU per token row -14%, tiny rows/s +17-19%.

What must not change is the promise of NOTE [ Writer cycle ]: rows a writer copied never stay invisible while it
waits. The writer's own waits are visible to it, and it publishes first: before it takes more empty slots or backs
off for want of them, and before it idles on an empty share. The one wait it cannot see is inside the dataset
(a stream with nothing new, a slow download). For that a daemon thread wakes every ``PUBLISH_WITHIN_S`` and
publishes any rows pending for at least that long, wherever the writer's main thread is. That is safe at any
moment: only rows whose copy has finished are pending, the two threads hand the list over under a lock, and the
slot table serializes the threads of one process itself (its ``flock`` would not: it is held per open file
description, which the threads share). A writer killed with rows pending leaves them ``writing`` under its pid,
and ``repair()`` returns them to empty as it always did: a dead writer loses the rows it had not published, now up
to ``rows_per_commit`` of them instead of one chunk; none is delivered torn or twice.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from types import TracebackType

import numpy as np

from gigashuffle.procs import failpoints
from gigashuffle.shm.lanes import NO_LANE
from gigashuffle.shm.picker import NO_IDS
from gigashuffle.shm.slottable import SlotIds, SlotTable

log = logging.getLogger(__name__)

# How long a copied row may stay unpublished while the writer is elsewhere (in its dataset): the watcher's period.
PUBLISH_WITHIN_S = 0.01
_CHUNKS_PER_COMMIT = 4
_MAX_BUFFER_SHARE = 16  # rows pending or reserved ahead: at most 1/16 of the buffer


def rows_per_commit(chunk_rows: int, slots: int) -> int:
    """Rows a writer copies between two commits when chunks of ``chunk_rows`` come fast: NOTE [ Deferred commits ]."""
    return max(chunk_rows, min(_CHUNKS_PER_COMMIT * chunk_rows, slots // _MAX_BUFFER_SHARE))


class PendingRows:
    """The slots a writer has written and not yet published, and the thread that publishes them if they wait.

    Use it as a context manager (or call ``close()``): leaving publishes what is still pending and stops the thread.
    """

    def __init__(
        self,
        table: SlotTable,
        pid: int,
        publish_within_s: float = PUBLISH_WITHIN_S,
        lane: int = NO_LANE,
    ) -> None:
        self.table = table
        self.pid = pid
        self.rows = 0
        self._ids: list[SlotIds] = []
        self._oldest = 0.0  # time.monotonic() of the first pending write
        self._lock = threading.Lock()
        # Held from taking the pending rows to their commit, so that the two publishing threads commit in the order
        # the rows were written: the lane counts a prefix of the stream (NOTE [ Respawned writers ]).
        self._publishing = threading.Lock()
        self.lane = lane  # grows with each commit, in the same journaled op (NOTE [ Lanes ] in shm/lanes.py)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_watch, args=(weakref.ref(self), self._stop, publish_within_s), name="gigashuffle-publish",
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._stop.set)

    def add(self, ids: SlotIds) -> None:
        """Slots whose rows this writer has just finished copying."""
        self._raise_if_failed()
        with self._lock:
            if not self._ids:
                self._oldest = time.monotonic()
            self._ids.append(ids)
            self.rows += len(ids)

    def publish(self) -> None:
        """Publish every pending row now."""
        self._raise_if_failed()
        with self._publishing:
            ids = self._take()
            if len(ids):
                self._check(self.table.commit_written(self.pid, ids, self.lane), ids)
                if failpoints.ACTIVE:
                    failpoints.reached("writer.after_commit")

    def publish_and_reserve(self, n: int, min_full: int) -> SlotIds:
        """Publish every pending row and reserve ``n`` empty slots under one hold of the lock (``commit_and_acquire``:
        all or none, and only while ``min_full`` slots stay reachable); returns the reserved slots."""
        if n <= 0:
            self.publish()
            return NO_IDS
        self._raise_if_failed()
        with self._publishing:
            ids = self._take()
            held, fresh = self.table.commit_and_acquire(self.pid, ids, n, min_full, self.lane)
            self._check(held, ids)
            if failpoints.ACTIVE and len(ids):
                failpoints.reached("writer.after_commit")
        return fresh

    def publish_overdue(self, age_s: float) -> None:
        """The watcher's step: publish the pending rows if the oldest has waited ``age_s``."""
        with self._lock:
            overdue = bool(self._ids) and time.monotonic() - self._oldest >= age_s
        if overdue:
            self.publish()

    def close(self) -> None:
        """Stop the watcher and publish what is pending. Safe to call twice."""
        self._finalizer()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if self._error is None:
            self.publish()

    def __enter__(self) -> PendingRows:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
            return
        try:  # the writer is failing already: publish what it copied if the table still lets us, but keep its error
            self.close()
        except Exception as late:
            log.warning("writer %d could not publish its pending rows while stopping: %r", self.pid, late)

    def _take(self) -> SlotIds:
        with self._lock:
            pending, self._ids, self.rows = self._ids, [], 0
        if not pending:
            return NO_IDS
        return pending[0] if len(pending) == 1 else np.concatenate(pending)

    def _check(self, held: int, ids: SlotIds) -> None:
        if held != len(ids):
            raise AssertionError(f"writer {self.pid} lost slots it was writing (repaired as a dead holder's?)")

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writer {self.pid}: publishing pending rows failed in the background") from self._error


def _watch(ref: weakref.ref[PendingRows], stop: threading.Event, period_s: float) -> None:
    """Publish rows pending for ``period_s`` every ``period_s``, until ``stop`` or the owner is gone."""
    while not stop.wait(period_s):
        pending = ref()
        if pending is None:
            return
        try:
            pending.publish_overdue(period_s)
        except Exception as exc:  # handed to the writer's main thread, which raises it at its next call
            pending._error = exc
            return
        finally:
            del pending
