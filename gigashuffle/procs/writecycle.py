"""The writer's loop: copy each chunk's rows into empty slots, publish them, reserve the next ones.

NOTE [ Writer cycle ]
Per chunk: the rows are copied, one row assignment per field and without any lock held, into empty slots the
writer holds as ``writing``, and join the rows pending publication. Once per ``rows_per_commit`` rows (four fast
chunks; every chunk for a small buffer or a chunk that was not reserved), one hold of the node lock both publishes
the pending rows (``full``, each with a new version) and reserves the slots for the next ones, if that many are
empty (``commit_and_acquire``: two journaled ops). Rows copied never stay invisible while the writer waits: it
publishes before it takes or waits for more slots and before it idles, and a thread publishes rows left pending
for 10 ms while the writer is inside its dataset (NOTE [ Deferred commits ] in procs/pending.py). What a writer holds
while its dataset waits is otherwise empty slots. A shorter next chunk leaves the rest reserved for the one
after; a longer one, or one with no reservation (the buffer was nearly full), acquires what it lacks as it goes
(``acquire_empty``, as many as are empty, publishing what is pending first). A writer about to idle on an empty
share gives its reservation back (``give_back``). A writer reserves only while the slots full or empty without
its reservation still number ``min_full_slots``: a reservation held while the source waits for data must not keep
the buffer from the readers' threshold (with fill_once, every slot: it reserves nothing ahead and publishes every
chunk). When nothing is empty the writer backs off from 0.5 ms and meanwhile answers the trainer's messages. No
Redis. A writer killed mid-copy leaves ``writing`` slots under its pid, which ``repair()`` returns to empty (their
rows may be torn), reserved and pending ones included.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gigashuffle.errors import SchemaError
from gigashuffle.procs import firstmix
from gigashuffle.procs.childenv import ChildEnv
from gigashuffle.procs.chores import Backoff, Housekeeping
from gigashuffle.procs.chunks import Chunks, before_fetch
from gigashuffle.procs.firstmix import FirstMix
from gigashuffle.procs.messages import MixShare
from gigashuffle.procs.pending import PendingRows, rows_per_commit
from gigashuffle.procs.resume import StreamPosition
from gigashuffle.procs.writercontrol import handle_control
from gigashuffle.schema import Layout
from gigashuffle.shm.counters import W_BLOCKED_S, W_CHUNKS, W_DATASET_S, W_ROWS, ChildCounters
from gigashuffle.shm.picker import NO_IDS
from gigashuffle.shm.rowcopies import ChunkRows, RowElements, row_elements
from gigashuffle.shm.slottable import SlotIds, SlotTable

log = logging.getLogger(__name__)

# Between chunks a writer reads the trainer's messages (a state request waits for the answer) at most this often.
_CONTROL_PERIOD_S = 0.001


def write_forever(env: ChildEnv, chunks: Chunks, chunk: Any, layout: Layout, counters: ChildCounters) -> None:
    buffer, table = env.buffer, env.table
    if buffer is None or table is None:
        raise AssertionError("writer has no buffer after attach")
    me = os.getpid()
    reserved = _Reservation(table, me)
    chores = Housekeeping(env)
    backoff = Backoff()
    min_full = env.config.min_full_slots  # a reservation must leave that many slots to fill: NOTE [ Writer cycle ]
    mix = FirstMix(env.config, table, env.spec.index, firstmix.empty_writers(env))  # NOTE [ First mix ]
    cells = counters.cells  # added to once per chunk or backoff, never per row
    control_due = 0.0  # when the trainer's messages are next read between chunks
    position, track = chunks.position, chunks.track
    chunk_rows = ChunkRows(layout)  # checks and cuts each chunk: NOTE [ Row copies ] in shm/rowcopies.py
    with PendingRows(table, me, lane=position.lanes[0]) as pending:  # NOTE [ Respawned writers ]

        def before_idle() -> None:  # an idle writer keeps neither rows unpublished nor slots reserved
            pending.publish()
            reserved.give_back()

        chunks.before_idle = before_idle
        chunks.before_restart = pending.publish

        def serve_trainer(done: int, saved: bool) -> None:
            """Answer the trainer's messages from inside a chunk (or saved rows): a pause answered here must count
            exactly the rows ``:done`` as in the buffer (NOTE [ Respawned writers ]), in every branch that waits;
            the chunk-start count would have a resume write them again."""
            if saved:
                position.restored = done
            else:
                position.done = done
            handle_control(env, chunks)

        def write(elements: list[RowElements], rows: int, done: int, saved: bool = False) -> None:
            """Copy rows ``done:`` (per field its ``row_elements``: NOTE [ Row copies ]) into slots, serving the
            trainer while no slot is empty; ``saved``: they are a checkpoint's saved rows (position.restored counts
            them), else the chunk's (position.done)."""
            serial = position.serial
            while done < rows:
                allowed = mix.allowed(rows - done)
                if not allowed:  # its share of the first mix is in: wait for the node's first read
                    pending.publish()
                    reserved.give_back()
                    serve_trainer(done, saved)
                    if position.serial != serial:
                        return  # a state was loaded: the rest of these rows is not part of the stream
                    chores.tick()
                    backoff.sleep()
                    continue
                if not reserved.held():
                    pending.publish()  # before this writer takes more slots, or waits for them
                    reserved.add(table.acquire_empty(me, allowed))
                    if not reserved.held():  # the buffer is full: this writer is blocked on the readers
                        blocked_since = time.monotonic()
                        serve_trainer(done, saved)
                        if position.serial != serial:
                            return  # a state was loaded: the rest of these rows is not part of the stream
                        chores.tick()
                        backoff.sleep()
                        cells[W_BLOCKED_S] += time.monotonic() - blocked_since
                        continue
                backoff.reset()
                slots = reserved.take(allowed)
                buffer.put(slots, elements, done)
                track.stamp(table.origin, slots, done, saved)
                done += len(slots)
                pending.add(slots)
                mix.wrote(len(slots))
                if mix.share_in():
                    env.channel.send(MixShare())

        while True:
            if position.restore_rows is not None:
                _write_back(position, layout, pending, write)
            if chunk is None:
                before_fetch(chunks)
                asked = time.monotonic()
                chunk = chunks.next()
                cells[W_DATASET_S] += time.monotonic() - asked
            rows, elements = chunk_rows(chunk)
            produced = position.produced
            skipped = position.take(rows)
            chosen = track.select(produced, rows, skipped)
            if chosen is None:
                write(elements, rows, skipped)
            else:  # a resumed writer re-reads: only the rows its checkpoint did not count as consumed
                write([f[chosen] for f in elements], len(chosen), 0)
            cells[W_ROWS] += rows
            cells[W_CHUNKS] += 1
            position.done = None
            per_commit = rows_per_commit(rows, buffer.slots)
            if pending.rows + rows > per_commit or reserved.held() < rows:  # NOTE [ Deferred commits ]
                reserved.add(pending.publish_and_reserve(per_commit - reserved.held(), min_full))
            now = time.monotonic()
            if now >= control_due:  # a poll syscall per fast chunk was ~1% of a tiny row's CPU
                control_due = now + _CONTROL_PERIOD_S
                chores.tick()
                handle_control(env, chunks)
            chunk = None


def _write_back(position: StreamPosition, layout: Layout, pending: PendingRows, write: Callable[..., None]) -> None:
    """Put a checkpoint's saved rows back into the buffer (NOTE [ Checkpoint cut ] in checkpoint/cut.py), published
    and not counted as rows of the dataset's stream. A cut meanwhile gets the rows not yet copied back with this
    writer's answer (``position.leftover()``)."""
    if position.restore_rows is None:
        return
    block = position.restore_rows
    saved = Layout.from_json(block.layout_json)
    if saved != layout:
        raise SchemaError(
            f"the checkpoint's saved rows have layout [{saved.describe()}] but this queue's buffer has "
            f"[{layout.describe()}]; resume with the dataset (fields, dtypes, row shapes) that wrote the checkpoint"
        )
    rows = len(block)
    pending.publish()  # rows of the stream so far are counted as such; the saved ones apart, for a successor
    pending.lane = position.lanes[1]
    serial = position.serial
    try:
        write([row_elements(f.numpy()) for f in block.as_tensors().fields], rows, 0, saved=True)
        pending.publish()
    finally:
        pending.lane = position.lanes[0]
    if position.serial == serial:  # else a new state (with its own rows, maybe) came meanwhile
        position.restore_rows, position.restored = None, 0
        log.info("wrote back %d rows saved by the checkpoint", rows)


class _Reservation:
    """Empty slots this writer holds (``writing`` under its pid) for its next rows: NOTE [ Writer cycle ]."""

    def __init__(self, table: SlotTable, me: int) -> None:
        self.table = table
        self.me = me
        self.ids: SlotIds = NO_IDS

    def held(self) -> int:
        return len(self.ids)

    def add(self, ids: SlotIds) -> None:
        self.ids = np.concatenate([self.ids, ids]) if len(self.ids) else ids

    def take(self, n: int) -> SlotIds:
        taken, self.ids = self.ids[:n], self.ids[n:]
        return taken

    def give_back(self) -> None:
        if len(self.ids):
            self.table.give_back(self.me, self.ids)
            self.ids = self.ids[:0]
