"""A writer's side of checkpoints: where its committed rows end in its dataset's stream, and the hold before reading.

NOTE [ Respawned writers ]
A writer of a stateful dataset (``state_dict``/``load_state_dict``) counts its stream: ``produced`` rows taken from
the dataset since the state it started from (serial ``serial``: each ``load_state_dict`` or respawn starts a new
one). Two records let the trainer find, after the writer died, exactly where its committed rows end:
  * the commit count: the writer's two lanes in the slot table (NOTE [ Lanes ] in shm/lanes.py), which each
    commit moves in the same journaled op as its slots (the stream's rows; a checkpoint's saved rows put back,
    NOTE [ Checkpoint cut ]), and 24 bytes of shared memory, ``[serial, stream base, saved base]``, whose memfd the
    writer sends with ``Attached``: the lanes' values where this stream started, less the rows it skips. So
    ``committed = stream lane - stream base`` counts exactly the rows of the stream full in the buffer, whatever
    instruction the writer died at (``PendingRows`` commits in stream order, under the lock that serializes the
    writer's two publishing threads);
  * ``Progress(serial, produced, state)``: the dataset's ``state_dict()`` taken just before a chunk is fetched,
    at most every ``REPORT_PERIOD_S`` (a handful of messages a second, never per chunk or per row).
When the writer dies, the trainer reads ``committed`` (the lanes under the node lock) and picks the latest report with
``produced <= committed`` (else the state the writer started from, at ``produced = 0``); the respawned writer loads that
state and skips ``committed - produced`` rows, so it writes the first row its predecessor had not committed. Rows it had
copied and not committed are ``writing`` slots that ``repair()`` returns to empty: they come again, once. What it
re-reads is bounded by the rows it takes in ``REPORT_PERIOD_S`` plus one commit. This needs a dataset that re-reads the
same rows after ``load_state_dict`` (its order a function of its state, not of a seed or clock). (Before lanes the count
was kept in the counter page after each commit, and a SIGKILL between the two repeated that commit's rows: 16 ids twice
in one run of tests/integration/test_checkpoint_exact.py.)
A checkpoint's per-writer
``skip`` is the same count for a writer
that has not finished skipping (``loader.state_dict()`` right after a respawn).

NOTE [ Restore before reading ]
A loader of a stateful dataset is often given its checkpoint right after construction, but maybe seconds later
(a model loads in between). So its writers take the first chunk (for the buffer's layout and the dummy row, which
come as fast as without a checkpoint), then hold before committing any row until the trainer says ``Go`` (the
first ``iter()``/batch request) or sends ``LoadState`` (which also means go: the writer discards the chunk it
took, loads the state and reads on from it). Meanwhile a ``state_dict()`` is answered with the state from before
that first chunk. Loaders of datasets without state, and loaders with ``num_readers=0`` (they never ask for a
batch), never hold.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np

from gigashuffle.procs.channel import Channel
from gigashuffle.procs.messages import Progress
from gigashuffle.resumepoint import ResumePoint
from gigashuffle.rowblock import RowBlock
from gigashuffle.shm.buffer import SharedMemory
from gigashuffle.shm.lanes import NO_LANE
from gigashuffle.shm.slottable import SlotTable

# How often a writer of a stateful dataset reports its dataset's state (NOTE [ Respawned writers ]).
REPORT_PERIOD_S = 0.05
COUNTER_BYTES = 24  # int64 [serial, stream base, saved base]: NOTE [ Respawned writers ]


class StreamPosition:
    """Where a writer is in its dataset's stream, and its commit counter in shared memory."""

    def __init__(self, stateful: bool, serial: int, skip: int, base_state: Any, lanes: tuple[int, int]) -> None:
        self.stateful = stateful
        self.serial = serial
        self.produced = 0  # rows taken from the dataset since the base state (skipped ones included)
        self.skip_left = skip
        self.base_state = base_state
        self.started = False  # rows of this stream were taken into the write loop
        self.chunk_state: Any = base_state  # the dataset's state before the chunk being written
        self.done: int | None = None  # rows of that chunk written or skipped, while the writer is inside it
        self.paused = False  # NOTE [ Checkpoint cut ]: between StateRequest(pause=True) and Resume
        self.restore_rows: RowBlock | None = None  # a checkpoint's rows, to write back first
        self.restored = 0  # how many of them are copied into the buffer
        self._report_due = 0.0
        self.lanes = lanes if stateful else (NO_LANE, NO_LANE)  # (stream, saved rows): NOTE [ Lanes ]
        self._table: SlotTable | None = None
        self.memory: SharedMemory | None = None
        self.counter: np.ndarray[Any, np.dtype[np.int64]] = np.zeros(COUNTER_BYTES // 8, dtype=np.int64)
        if stateful:
            self.memory = SharedMemory(COUNTER_BYTES, name="gigashuffle-commits")
            self.counter = np.frombuffer(self.memory.numpy_view(0, COUNTER_BYTES), dtype=np.int64)
        self.counter[:] = (serial, 0, 0)

    def fds(self) -> tuple[int, ...]:
        return () if self.memory is None or self.memory.fd is None else (self.memory.fd,)

    def bind(self, table: SlotTable) -> None:
        """The buffer is attached (before ``Attached`` is sent and before any commit): note the lanes' bases. The
        read takes the node lock, so a commit a dead predecessor was inside is rolled forward first."""
        self._table = table
        self._set_bases(table.lane_values(self.lanes) if self.lanes[0] >= 0 else (0, 0))

    def _set_bases(self, lanes_now: tuple[int, ...]) -> None:
        # The bases first and the serial last: a trainer that finds the old serial (the writer died in between)
        # starts its successor from the state it sent, and never pairs the new serial with old bases.
        self.counter[1] = lanes_now[0] - self.skip_left
        self.counter[2] = lanes_now[1]
        self.counter[0] = self.serial

    def restart(self, state: Any, skip: int, serial: int) -> None:
        """A new base: ``state`` was loaded; its first ``skip`` rows are written already. Pending rows of the old
        stream must be published before (the lanes are this writer's own: nothing else moves them now)."""
        self.serial, self.produced, self.skip_left, self.base_state = serial, 0, skip, state
        self.chunk_state, self.done, self.started = state, None, False
        if self._table is not None and self.lanes[0] >= 0:
            self._set_bases(tuple(int(self._table.lanes[lane]) for lane in self.lanes))
        else:
            self.counter[0] = serial  # bound later: bind() sets the bases
        self._report_due = 0.0

    def before_fetch(self, dataset: Any, channel: Channel) -> None:
        """Note the dataset's state before the next chunk (one ``state_dict()`` per chunk, stateful datasets only)
        and report it when a report is due."""
        if not self.stateful:
            return
        self.chunk_state = dataset.state_dict()
        now = time.monotonic()
        if now < self._report_due:
            return
        self._report_due = now + REPORT_PERIOD_S
        channel.send(Progress(self.serial, self.produced, self.chunk_state))

    def take(self, rows: int) -> int:
        """A chunk of ``rows`` rows enters the write loop: how many of its first rows to skip."""
        self.started = True
        skipped = min(self.skip_left, rows)
        self.skip_left -= skipped
        self.produced += rows
        self.done = skipped
        return skipped

    def answer(self, dataset: Any) -> tuple[Any, int]:
        """(state, skip) for ``state_dict()``: every row after it not yet in the buffer comes after ``skip`` rows.
        The base while holding; inside a chunk, the state before it and the rows of it written; else the state."""
        if not self.started:
            return self.base_state, self.skip_left
        if self.done is not None:
            return self.chunk_state, self.done
        return dataset.state_dict(), self.skip_left

    def leftover(self) -> RowBlock:
        """The checkpoint's saved rows not yet copied back: a cut now must save them again."""
        return RowBlock() if self.restore_rows is None else self.restore_rows.after(self.restored)

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()


def initial_position(dataset: Any, stateful: bool, point: ResumePoint, lanes: tuple[int, int]) -> StreamPosition:
    """Load the point's state (None: the dataset as pickled) and note it as the stream's base, with the point's
    skip, serial and saved rows (a checkpoint's rows a predecessor had not put back yet)."""
    if point.state is not None:
        dataset.load_state_dict(point.state)
    base = copy.deepcopy(dataset.state_dict()) if stateful and point.state is None else point.state
    position = StreamPosition(stateful, point.serial, point.skip, base, lanes)
    if len(point.rows):
        position.restore_rows = point.rows
    return position
