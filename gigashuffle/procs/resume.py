"""A writer's side of checkpoints: where its committed rows end in its dataset's stream, and the hold before reading.

NOTE [ Respawned writers ]
A writer of a stateful dataset (``state_dict``/``load_state_dict``) counts its stream: ``produced`` rows taken from
the dataset since the state it started from (serial ``serial``: each ``load_state_dict`` or respawn starts a new
one). Two records let the trainer find, after the writer died, exactly where its committed rows end:
  * the commit counter: 24 bytes of shared memory (``[serial, committed, restored]``; the last counts a
    checkpoint's saved rows put back, NOTE [ Checkpoint cut ]) whose memfd the writer sends with
    ``Attached``; ``PendingRows`` adds each commit's row count right after the commit, under the lock that
    serializes the writer's two publishing threads, so commits land in stream order;
  * ``Progress(serial, produced, state)``: the dataset's ``state_dict()`` taken just before a chunk is fetched,
    at most every ``REPORT_PERIOD_S`` (a handful of messages a second, never per chunk or per row).
When the writer dies, the trainer reads ``committed`` and picks the latest report with ``produced <= committed``
(else the state the writer started from, at ``produced = 0``); the respawned writer loads that state and skips
``committed - produced`` rows, so it writes the first row its predecessor had not committed. Rows it had copied
and not committed are ``writing`` slots that ``repair()`` returns to empty: they come again, once. What it
re-reads is bounded by the rows it takes in ``REPORT_PERIOD_S`` plus one commit. This needs a dataset that
re-reads the same rows after ``load_state_dict`` (its order a function of its state, not of a seed or clock).
The one window left: a SIGKILL between a commit and the counter's update (a few instructions) repeats that
commit's rows (at most ``rows_per_commit``). A checkpoint's per-writer ``skip`` is the same count for a writer
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
from gigashuffle.shm.buffer import SharedMemory

# How often a writer of a stateful dataset reports its dataset's state (NOTE [ Respawned writers ]).
REPORT_PERIOD_S = 0.05
COUNTER_BYTES = 24  # int64 [serial, committed, restored]


class StreamPosition:
    """Where a writer is in its dataset's stream, and its commit counter in shared memory."""

    def __init__(self, stateful: bool, serial: int, skip: int, base_state: Any) -> None:
        self.stateful = stateful
        self.serial = serial
        self.produced = 0  # rows taken from the dataset since the base state (skipped ones included)
        self.skip_left = skip
        self.base_state = base_state
        self.started = False  # rows of this stream were taken into the write loop
        self.chunk_state: Any = base_state  # the dataset's state before the chunk being written
        self.done: int | None = None  # rows of that chunk written or skipped, while the writer is inside it
        self.paused = False  # NOTE [ Checkpoint cut ]: between StateRequest(pause=True) and Resume
        self.restore_rows: tuple[str, tuple[Any, ...]] | None = None  # a checkpoint's rows, to write back first
        self.restored = 0  # how many of them are copied into the buffer
        self._report_due = 0.0
        self.memory: SharedMemory | None = None
        self.counter: np.ndarray[Any, np.dtype[np.int64]] = np.zeros(COUNTER_BYTES // 8, dtype=np.int64)
        if stateful:
            self.memory = SharedMemory(COUNTER_BYTES, name="gigashuffle-commits")
            self.counter = np.frombuffer(self.memory.numpy_view(0, COUNTER_BYTES), dtype=np.int64)
        self.counter[:] = (serial, skip, 0)

    def fds(self) -> tuple[int, ...]:
        return () if self.memory is None or self.memory.fd is None else (self.memory.fd,)

    def committed(self, rows: int) -> None:
        """``rows`` more rows of the stream are full in the buffer (called under the publishing lock)."""
        self.counter[1] += rows

    def committed_saved(self, rows: int) -> None:
        """``rows`` more of a checkpoint's saved rows are full in the buffer again (NOTE [ Checkpoint cut ])."""
        self.counter[2] += rows

    def restart(self, state: Any, skip: int, serial: int) -> None:
        """A new base: ``state`` was loaded; its first ``skip`` rows are written already. Pending rows of the old
        stream must be published before."""
        self.serial, self.produced, self.skip_left, self.base_state = serial, 0, skip, state
        self.chunk_state, self.done, self.started = state, None, False
        self.counter[:] = (serial, skip, 0)
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

    def leftover(self) -> tuple[str, tuple[Any, ...]]:
        """The checkpoint's saved rows not yet copied back: a cut now must save them again."""
        if self.restore_rows is None:
            return "", ()
        layout_json, fields = self.restore_rows
        return layout_json, tuple(f[self.restored :] for f in fields)

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()


def initial_position(
    dataset: Any, stateful: bool, state: Any, skip: int, serial: int, saved: tuple[str, tuple[Any, ...]]
) -> StreamPosition:
    """Load ``state`` (None: the dataset as pickled) and note it as the stream's base; ``saved``: a checkpoint's
    rows its predecessor had not put back yet (layout JSON, fields)."""
    if state is not None:
        dataset.load_state_dict(state)
    base = copy.deepcopy(dataset.state_dict()) if stateful and state is None else state
    position = StreamPosition(stateful, serial, skip, base)
    if saved[1]:
        position.restore_rows = saved
    return position
