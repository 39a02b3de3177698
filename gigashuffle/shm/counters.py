"""Counters a writer or reader keeps in a page of shared memory for the trainer's ``loader.metrics()``.

NOTE [ Child counters ]
Each child creates one small memfd of float64 cells at start and hands its fd to its trainer with the message it
sends once anyway (``Attached`` for a writer, ``RingReady`` for a reader). From then on the child adds to its cells
once per chunk (writer) or per draw (reader), never per row, and the trainer reads them whenever ``metrics()`` is
called: no lock, no message, no Redis. One process writes each cell and every cell is one aligned 8-byte word, so
a read sees a value that was true at some moment; two cells read together may straddle one chunk or draw, which a
rate over seconds does not notice. Times are ``time.monotonic()`` seconds, one clock for every process of a host.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from gigashuffle.shm.memfd import SharedMemory

# Writer cells.
W_STARTED = 0  # monotonic time the writer started counting
W_ROWS = 1  # rows copied into the buffer
W_DATASET_S = 2  # seconds inside the dataset's __iter__/__next__ (waiting for the next chunk)
W_BLOCKED_S = 3  # seconds with rows to write and no empty slot (the buffer is full)
W_CHUNKS = 4
# Reader cells.
R_STARTED = 0
R_BATCHES = 1  # batches gathered into the ring
R_GATHER_S = 2  # seconds copying rows out of the buffer into the ring
R_STARVED_S = 3  # seconds with a free ring slot and too few full slots to draw (the mixing threshold)
R_FILL_SUM = 4  # sum of the full-slot count seen at each draw attempt
R_FILL_N = 5
R_FILL_MIN = 6  # least full-slot count seen since the trainer last set R_FILL_RESET
R_FILL_RESET = 7  # the trainer sets it to 1 after reading R_FILL_MIN; the reader's next sample starts afresh
R_AGE_SUM = 8  # sum over drawn rows of (version clock at draw - the row's version): rows written since
R_AGE_N = 9
R_WRITERS_SUM = 10  # sum over sampled batches of the distinct writers (pids) of their rows
R_WRITERS_N = 11  # batches sampled (the first of each draw)

CELLS = 16
NBYTES = CELLS * 8
# The reader's figures per drawn row (its age, the distinct writers of a batch) are a sum and a count whose ratio is
# the figure, so the reader adds them on its first draw and then on one in SAMPLE_EVERY (``Every``): the ratio's
# expectation is the same, and the other draws skip their cost (a sum over the draw's versions and a sort of a
# batch's writer pids: about 5 us per 1,024-row draw, a tenth of a tiny batch's reader CPU).
SAMPLE_EVERY = 8


class ChildCounters:
    """The cells of one child: made by the child (``fd`` None), mapped by the trainer from the fd it sent."""

    def __init__(self, fd: int | None = None) -> None:
        self.memory = SharedMemory(NBYTES, fd, name="gigashuffle-counters")
        self.cells: np.ndarray[Any, np.dtype[np.float64]] = self.memory.numpy_view(0, NBYTES).view(np.float64)
        # The same cells as a memoryview, for the child's adds: a third of a numpy scalar update's cost, and still
        # one aligned 8-byte store per cell.
        self.words = self.memory.numpy_view(0, NBYTES).data.cast("d")
        if fd is None:
            self.cells[R_STARTED] = time.monotonic()  # W_STARTED is the same cell
            self.cells[R_FILL_RESET] = 1.0

    def read(self) -> np.ndarray[Any, np.dtype[np.float64]]:
        """A copy of every cell (eight words: far cheaper than reading them one by one)."""
        return self.cells.copy()

    def sample_fill(self, full: int) -> None:
        """Reader: account one sample of the buffer's full-slot count."""
        words = self.words
        words[R_FILL_SUM] += full
        words[R_FILL_N] += 1
        if words[R_FILL_RESET] or full < words[R_FILL_MIN]:
            words[R_FILL_MIN] = full
            words[R_FILL_RESET] = 0.0

    def close(self) -> None:
        self.memory.close()


class Every:
    """True on the first call and then on one call in ``n`` (the reader's sampled draws: ``SAMPLE_EVERY``)."""

    def __init__(self, n: int = SAMPLE_EVERY) -> None:
        self.n = n
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls % self.n == 1 or self.n == 1
