"""The slot table's transitions, timed alone: what a writer and a reader spend per row on the node lock's work.

One process, no rows copied, no Redis: a writer's ``acquire_empty`` and ``commit_written`` per chunk and a reader's
draw and release per batch, with the sizes of ``gigashuffle bench``'s workloads. Every figure is CPU seconds per
1,000 rows written and read again, so lower is better, as asv assumes.
"""

from __future__ import annotations

import os
import time

from gigashuffle.bench.workloads import WORKLOADS
from gigashuffle.slottable import SlotIds, SlotTable

ROWS = 1_000
FILL = 0.6  # the share of full slots kept: a reader needs half of them full (min_mixing 0.5) and draws from them
WORKLOAD_NAMES = ["tiny", "tokens"]  # image moves 64-row chunks like tokens, in a table 4x smaller


class _Fixture:
    """A table of one workload's size held at ``FILL`` full, and this process's pid as every holder."""

    def __init__(self, name: str) -> None:
        workload = WORKLOADS[name]
        self.chunk, self.bs = workload.chunk_rows, workload.bs
        self.table = SlotTable(workload.shuffle_size, seed=0)
        self.pid = os.getpid()
        while self.table.snapshot().full < FILL * workload.shuffle_size:
            self.table.commit_written(self.pid, self.table.acquire_empty(self.pid, self.chunk))
        self.batch: SlotIds = self.table.draw_full(self.pid, self.bs)[0]  # a reader always holds its last batch

    def cycle(self, rows: int) -> None:
        """Write ``rows`` rows in chunks and read as many in batches, as a writer and a reader do."""
        table, pid = self.table, self.pid
        for _ in range(-(-rows // self.chunk)):
            table.commit_written(pid, table.acquire_empty(pid, self.chunk))
        fused = getattr(table, "release_and_draw", None)  # a reader's one lock hold per batch, where it exists
        for _ in range(-(-rows // self.bs)):
            if fused is not None:
                _released, self.batch, _versions = fused(pid, self.batch, True, self.bs)
            else:  # commits before it: the release and the draw as two ops, so asv can compare across them
                table.release_read(pid, self.batch, True)
                self.batch = table.draw_full(pid, self.bs)[0]


_FIXTURES: dict[str, _Fixture] = {}


class Transitions:
    """The slot table's work for 1,000 rows written and read (see ``_Fixture.cycle``)."""

    params = (WORKLOAD_NAMES,)
    param_names = ("workload",)
    rounds = 4  # as in bench_buffer: samples from several processes, interleaved between commits
    repeat = (10, 50, 4.0)
    warmup_time = 0.2
    timer = time.process_time  # CPU of this one thread: unlike wall time, it does not count other jobs' turns
    timeout = 300

    def setup(self, workload: str) -> None:
        if workload not in _FIXTURES:
            _FIXTURES[workload] = _Fixture(workload)
        self.fixture = _FIXTURES[workload]

    def time_write_and_read_1000_rows(self, workload: str) -> None:
        self.fixture.cycle(ROWS)
