"""The writer loop: pull chunks from the dataset, copy their rows into empty slots, publish them.

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

NOTE [ Empty shares ]
Writers see a job-wide ``get_worker_info()``, so a source that shards by worker (Hugging Face ``datasets``,
webdataset's ``split_by_worker``) gives a writer nothing when it has fewer shards than the job has writers: every
pass ends at once. After ``writer_max_retries`` such passes in a row the writer idles on its channel (no busy
loop, still answering ``state_dict``), and tries its dataset again after ``load_state_dict`` or a new training
context; it is not a failure. Only if no writer of the node publishes the buffer within a grace period is the
node's data empty, which is an error. Chunks with zero rows still count towards ``writer_max_retries`` and fail.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from gigashuffle.control import dummyrow
from gigashuffle.errors import SchemaError
from gigashuffle.procs import firstmix
from gigashuffle.procs.channel import Channel
from gigashuffle.procs.childenv import NO_CONTEXT, Backoff, ChildEnv, ChildSpec, Housekeeping
from gigashuffle.procs.firstmix import FirstMix
from gigashuffle.procs.forgottenbuffer import find_served_buffer
from gigashuffle.procs.messages import (
    Attached,
    DatasetState,
    Go,
    LoadState,
    MixShare,
    Rejoin,
    Resume,
    SetContext,
    SetEpoch,
    StateRequest,
)
from gigashuffle.procs.pending import PendingRows, rows_per_commit
from gigashuffle.procs.positions import KEEP_BUFFERS, Track, lane_of
from gigashuffle.procs.resume import StreamPosition, initial_position
from gigashuffle.procs.workerinfo import become_worker
from gigashuffle.schema import Layout
from gigashuffle.shm.counters import W_BLOCKED_S, W_CHUNKS, W_DATASET_S, W_ROWS, ChildCounters
from gigashuffle.shm.lanes import writer_lanes
from gigashuffle.shm.picker import NO_IDS
from gigashuffle.shm.slottable import SlotIds, SlotTable

log = logging.getLogger(__name__)

_IDLE_POLL_S = 1.0
# Between chunks a writer reads the trainer's messages (a state request waits for the answer) at most this often.
_CONTROL_PERIOD_S = 0.001
# How long a writer with an empty share waits for another writer of its node to publish the buffer before it
# calls the whole node's data empty: generous, since a peer's first chunk may need a slow download.
_EMPTY_SHARE_GRACE_S = 300.0


class _Chunks:
    """The dataset's chunks, forever: an ended iterator starts the next pass; too many empty chunks is an error.

    A writer whose share of the dataset is empty (a sharded source with fewer shards than the job has writers:
    every pass ends without a single chunk) idles instead, once another writer has published the node's buffer:
    see NOTE [ Empty shares ].
    """

    def __init__(self, spec: ChildSpec, env: ChildEnv, position: StreamPosition, track: Track) -> None:
        self.dataset = spec.dataset
        self.env = env
        self.position = position
        self.track = track  # NOTE [ Positions checkpoint ] in checkpoint/positions.py
        self.limit = spec.config.writer_max_retries
        self._it: Iterator[Any] | None = None
        self._yielded = False  # whether the current pass has yielded any chunk
        # Called before the writer idles on an empty share: it must not keep empty slots reserved meanwhile.
        self.before_idle: Callable[[], None] = _nothing
        # Called before a loaded state replaces the stream: rows copied from the old one are published first.
        self.before_restart: Callable[[], None] = _nothing

    def restart(self) -> None:
        self._it = None

    def next(self) -> Any:
        empty = barren = 0  # empty chunks or passes in a row; how many of them were passes without any chunk
        while True:
            if self._it is None:
                self._it = iter(self.dataset)
                self._yielded = False
            try:
                chunk = next(self._it)
                self._yielded = True
            except StopIteration:
                self._it = None
                chunk = None
                barren += not self._yielded
            if chunk is not None and not _is_empty(chunk):
                return chunk
            empty += 1
            if empty > self.limit and barren == empty:
                self._idle(barren)
                empty = barren = 0
            elif empty > self.limit:
                raise SchemaError(
                    f"the dataset produced {empty} empty chunks or passes in a row (writer_max_retries="
                    f"{self.limit}); make its __iter__ yield chunks with at least one row"
                )

    def _idle(self, passes: int) -> None:
        """Wait, serving the trainer, until a new context or dataset state may give this writer rows again."""
        info = get_worker_info()
        who = f"writer {self.env.spec.index} (get_worker_info().id={info.id} of {info.num_workers})" if info else ""
        cfg = self.env.config
        log.info(
            "%s of queue %r: the dataset ended %d passes in a row without a chunk, so this writer's share is empty "
            "(a source with fewer shards than the job's writers?); it idles until load_state_dict or a new "
            "training context",
            who, cfg.queue_name, passes,
        )  # fmt: skip
        self.before_idle()
        if dummyrow.is_dummy_writer(cfg, self.env.spec.index):
            env = self.env
            dummyrow.publish_absent(env.store, env.secret, env.spec.generation, env.proc)
        deadline = time.monotonic() + _EMPTY_SHARE_GRACE_S
        published = False
        firstmix.mark_empty_share(self.env, True)  # the node's other writers' first-mix shares grow: NOTE [ First mix ]
        while True:
            if self.env.channel.poll(_IDLE_POLL_S) and _handle_control(self.env, self):
                firstmix.mark_empty_share(self.env, False)
                return
            if published:
                continue
            published = "hmac" in self.env.store.meta()
            if not published and time.monotonic() > deadline:
                raise SchemaError(
                    f"{who}: the dataset ended {passes} passes in a row without a chunk (writer_max_retries="
                    f"{self.limit}) and no writer of node {cfg.node!r} produced a row within "
                    f"{_EMPTY_SHARE_GRACE_S:.0f} s: the dataset is empty, or its shards are fewer than the job's "
                    "writers and none fell to this node; add shards or use fewer writers"
                )


def _nothing() -> None:
    pass


def _is_empty(chunk: Any) -> bool:
    try:
        first = next(iter(chunk[0].values()))
        return len(first) == 0
    except (TypeError, IndexError, KeyError, StopIteration, AttributeError):
        return False  # malformed: let the layout check explain what is wrong


def _handle_control(env: ChildEnv, chunks: _Chunks) -> bool:
    """Apply the trainer's messages; True if one may change what the dataset yields (a context or a state). Paused
    by a checkpoint's cut, it returns only after ``Resume`` (NOTE [ Checkpoint cut ] in checkpoint/cut.py)."""
    changed = False
    position = chunks.position
    while env.channel.poll(_IDLE_POLL_S if position.paused else 0) or position.paused:
        if env.channel.poll(0):
            message, _ = env.channel.recv()
            changed = _apply(env, chunks, message) or changed
        elif env.table is not None and (repaired := env.table.repair()):
            log.info("returned %d slots of dead processes", repaired)
    return changed


def _apply(env: ChildEnv, chunks: _Chunks, message: Any) -> bool:
    dataset, position = env.spec.dataset, chunks.position
    if isinstance(message, SetContext):
        dataset.context = message.context
        return True
    if isinstance(message, SetEpoch):
        dataset.set_epoch(message.epoch)
        return True
    if isinstance(message, LoadState):
        point = message.point
        chunks.before_restart()
        dataset.load_state_dict(point.state)
        chunks.restart()
        # A filter takes the skip in (procs/positions.py) before the lane's base is set from it.
        skip = chunks.track.restart(point.base, point.state, point.keep, point.until, point.skip)
        position.restart(point.state, skip, point.serial)
        position.restore_rows = point.rows if len(point.rows) else None
        position.restored = 0
        env.spec.go = True
        return True
    if isinstance(message, Go):
        env.spec.go = True
    elif isinstance(message, StateRequest):
        if message.pause:
            chunks.before_restart()  # every row copied is published: the cut finds it full in the buffer
            position.paused = True
        state, skip = position.answer(dataset)
        where = chunks.track.answer(position.started, position.produced, skip, position.done)
        env.channel.send(DatasetState(message.request, env.spec.index, state, skip, position.leftover(), where))
    elif isinstance(message, Resume):
        position.paused = False
    elif isinstance(message, Rejoin):
        env.rejoin(message.generation)
    else:
        log.warning("writer %d ignores an unexpected %s", env.spec.index, type(message).__name__)
    return False


def run(spec: ChildSpec, channel: Channel) -> None:
    become_worker(spec.config, spec.index, spec.dataset, spec.seed, spec.start)
    if spec.context is not NO_CONTEXT:
        spec.dataset.context = spec.context
    if spec.epoch is not None:
        spec.dataset.set_epoch(spec.epoch)
    lanes = writer_lanes(spec.config.local_rank, spec.index)
    point = spec.point
    position = initial_position(spec.dataset, spec.stateful, point, lanes)
    cfg = spec.config
    positions = cfg.checkpoint_rows == "positions" and spec.stateful and cfg.delivers_once
    track = Track(positions, lane_of(cfg.local_rank, cfg.num_writers, spec.index), int(KEEP_BUFFERS * cfg.shuffle_size))
    # A filter takes the skip in (procs/positions.py); the lane's base is set from it when the buffer is bound.
    position.skip_left = track.restart(point.base, position.base_state, point.keep, point.until, point.skip)
    env = ChildEnv(spec, channel)
    try:
        _run(spec, env, position, track)
    finally:
        env.close()
        position.close()


def _run(spec: ChildSpec, env: ChildEnv, position: StreamPosition, track: Track) -> None:
    chunks = _Chunks(spec, env, position, track)
    _handle_control(env, chunks)
    _before_fetch(chunks)
    chunk = chunks.next()
    layout = Layout.from_chunk(chunk)
    if env.store.meta().get("layout") is None:
        served = find_served_buffer(env.runtime_dir, env.scope)  # NOTE [ A buffer Redis forgot ]
        held = env.adopt_buffer(served) if served is not None else None
        if held is None:  # no live buffer of this queue on this node (or none that fits): allocate one
            _rows, as_bytes = layout.rows_in(chunk)
            first_row = b"".join(field[0].numpy().tobytes() for field in as_bytes)
            held = env.publish_buffer(layout, first_row)
        if not held:
            env.attach_buffer()
    else:
        env.attach_buffer()
    published, meta = env.read_meta()
    if published != layout:
        raise SchemaError(
            f"this writer's chunks have layout [{layout.describe()}] but the buffer of queue "
            f"{spec.config.queue_name!r} was created for [{published.describe()}]; every writer of a queue "
            "must yield the same fields, dtypes and row shapes"
        )
    if env.table is None:
        raise AssertionError("writer has no slot table after attach")
    position.bind(env.table)  # NOTE [ Respawned writers ]: before the trainer maps the counter, before any commit
    counters = ChildCounters()  # NOTE [ Child counters ] in shm/counters.py: its fd travels first with Attached
    if counters.memory.fd is None:
        raise AssertionError("new counters have no fd")
    env.channel.send(Attached(), (counters.memory.fd, *position.fds()))
    counters.memory.close_fd()
    if dummyrow.is_dummy_writer(spec.config, spec.index):
        env.dummy_row = (meta["layout"], dummyrow.row_bytes(layout, chunk))
        dummyrow.publish_row(env.store, env.secret, spec.generation, *env.dummy_row, env.proc)
    if not _hold(env, chunks):
        chunk = None  # a state was loaded: the chunk taken for the layout is not part of the stream any more
    _write_forever(env, chunks, chunk, layout, counters)


def _before_fetch(chunks: _Chunks) -> None:
    """Note the dataset's state before the next chunk (NOTE [ Respawned writers ], [ Positions checkpoint ])."""
    position = chunks.position
    position.before_fetch(chunks.dataset, chunks.env.channel)
    if position.stateful:
        chunks.track.before_chunk(position.produced, position.chunk_state)


def _hold(env: ChildEnv, chunks: _Chunks) -> bool:
    """Wait for ``Go`` or ``LoadState`` before committing any row (NOTE [ Restore before reading ] in
    procs/resume.py); False if a state was loaded meanwhile."""
    serial = chunks.position.serial
    chores = Housekeeping(env)
    while not env.spec.go:
        if env.channel.poll(_IDLE_POLL_S):
            _handle_control(env, chunks)
        chores.tick()
    return chunks.position.serial == serial


def _write_forever(env: ChildEnv, chunks: _Chunks, chunk: Any, layout: Layout, counters: ChildCounters) -> None:
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
            _handle_control(env, chunks)

        def write(as_bytes: list[torch.Tensor], rows: int, done: int, saved: bool = False) -> None:
            """Copy rows ``done:`` into slots, serving the trainer while no slot is empty; ``saved``: they are a
            checkpoint's saved rows (position.restored counts them), else the chunk's (position.done)."""
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
                buffer.write(slots, as_bytes, done)
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
                _before_fetch(chunks)
                asked = time.monotonic()
                chunk = chunks.next()
                cells[W_DATASET_S] += time.monotonic() - asked
            rows, as_bytes = layout.rows_in(chunk)
            produced = position.produced
            skipped = position.take(rows)
            chosen = track.select(produced, rows, skipped)
            if chosen is None:
                write(as_bytes, rows, skipped)
            else:  # a resumed writer re-reads: only the rows its checkpoint did not count as consumed
                index = torch.from_numpy(chosen)
                write([f.index_select(0, index) for f in as_bytes], len(chosen), 0)
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
                _handle_control(env, chunks)
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
        write(list(block.fields), rows, 0, saved=True)
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
