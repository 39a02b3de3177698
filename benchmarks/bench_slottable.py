"""The slot table's transitions, timed alone: what a writer and a reader spend per row on the node lock's work.

One process, no rows copied, no Redis: a writer's ``acquire_empty`` and ``commit_written`` per chunk and a reader's
draw and release per batch, with the sizes of ``gigashuffle bench``'s workloads. Every figure is CPU seconds per
1,000 rows written and read again, so lower is better, as asv assumes.
"""

from __future__ import annotations

import os
import time

import numpy as np

from gigashuffle.shm.slottable import SlotIds, SlotTable
from gigashuffle.tools.bench.workloads import WORKLOADS

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
        while self.table.stats().full < FILL * workload.shuffle_size:
            self.table.commit_written(self.pid, self.table.acquire_empty(self.pid, self.chunk))
        self.batch: SlotIds = self.table.draw_full(self.pid, self.bs)[0]  # a reader always holds its last batch

    def cycle(self, rows: int, origins: bool = False) -> None:
        """Write ``rows`` rows in chunks and read as many in batches, as a writer and a reader do; ``origins``:
        stamp each written slot's origin and read each drawn one's, as they do checkpointing by positions."""
        table, pid = self.table, self.pid
        stamp = np.arange(self.chunk, dtype=np.int64)
        for _ in range(-(-rows // self.chunk)):
            ids = table.acquire_empty(pid, self.chunk)
            if origins:
                table.origin[ids] = stamp[: len(ids)]
            table.commit_written(pid, ids)
        fused = getattr(table, "release_and_draw", None)  # a reader's one lock hold per batch, where it exists
        for _ in range(-(-rows // self.bs)):
            if origins:
                self.origins = table.origin[self.batch]
            if fused is not None:
                _released, self.batch, _versions = fused(pid, self.batch, True, self.bs)
            else:  # commits before it: the release and the draw as two ops, so asv can compare across them
                table.release_read(pid, self.batch, True)
                self.batch = table.draw_full(pid, self.bs)[0]


_FIXTURES: dict[str, _Fixture] = {}


def _fixture(workload: str) -> _Fixture:
    """One table per workload for the process: its fill is set up once, and every benchmark of it goes on from
    where the last one left it (as a running loader's table does)."""
    if workload not in _FIXTURES:
        _FIXTURES[workload] = _Fixture(workload)
    return _FIXTURES[workload]


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
        self.fixture = _fixture(workload)

    def time_write_and_read_1000_rows(self, workload: str) -> None:
        self.fixture.cycle(ROWS)

    def time_write_and_read_1000_rows_with_origins(self, workload: str) -> None:
        """The same with origin tracking (``checkpoint_rows="positions"``): its cost per row on the table's side
        (NOTE [ Version and origin ] in shm/slotmap.py)."""
        self.fixture.cycle(ROWS, origins=True)


class LockHold:
    """How long the node lock is held per 1,000 rows written and read in ``Transitions``' cycle: the part of that
    work which every writer and reader of a node waits for, and so what bounds a node's rate of small rows
    whatever its cores (NOTE [ Node lock budget ] in shm/slottable.py). From the table's own ``lock_usage()``."""

    params = (WORKLOAD_NAMES,)
    param_names = ("workload",)
    repeat = (5, 20, 10.0)
    timeout = 300
    CYCLES = 20

    def setup(self, workload: str) -> None:
        self.fixture = _fixture(workload)

    def track_lock_hold_us_per_1000_rows(self, workload: str) -> float:
        table = self.fixture.table
        before = table.lock_usage()
        self.fixture.cycle(self.CYCLES * ROWS)
        return round((table.lock_usage().held_s - before.held_s) * 1e6 / self.CYCLES, 2)

    track_lock_hold_us_per_1000_rows.unit = "us"  # type: ignore[attr-defined]


def _write_for(table: SlotTable, chunk: int, seconds: float) -> tuple[int, float]:
    """A writer's transitions for ``seconds``: rows committed and the CPU seconds it took."""
    pid, rows, cpu = os.getpid(), 0, time.process_time()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ids = table.acquire_empty(pid, chunk)
        rows += table.commit_written(pid, ids) if len(ids) else 0
    return rows, time.process_time() - cpu


class TwoProcesses:
    """A writer process and a reader process on one table at once: what hand-offs of the node lock and of the
    table's cache lines between cores add to ``Transitions`` (on 2 cores, 1.8x for tiny, 2.3x for tokens when
    this was written). CPU of both per row read, so lower is better."""

    params = (WORKLOAD_NAMES,)
    param_names = ("workload",)
    repeat = (3, 10, 20.0)
    timeout = 300
    SECONDS = 1.0

    def setup(self, workload: str) -> None:
        self.fixture = _Fixture(workload)  # a fresh table: the forked writer must not inherit a used lock fd

    def track_cpu_us_per_row(self, workload: str) -> float:
        fixture, table = self.fixture, self.fixture.table
        done_r, done_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer: report and leave without running any of the parent's cleanup
            code = 1
            try:
                rows, cpu = _write_for(table, fixture.chunk, self.SECONDS)
                os.write(done_w, f"{rows} {cpu}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(done_w)
        me, rows, cpu = os.getpid(), 0, time.process_time()
        min_full = table.slots // 2  # as min_mixing 0.5: readers wait for the writer instead of emptying the table
        end = time.monotonic() + self.SECONDS
        while time.monotonic() < end:
            released, fixture.batch, _ = table.release_and_draw(me, fixture.batch, True, fixture.bs, min_full)
            rows += released
        cpu = time.process_time() - cpu
        with os.fdopen(done_r, "rb") as report:
            written = report.read().split()
        _, status = os.waitpid(pid, 0)
        if status != 0 or len(written) != 2:
            raise RuntimeError(f"the writer process failed (wait status {status})")
        return round((cpu + float(written[1])) * 1e6 / max(rows, 1), 4)

    track_cpu_us_per_row.unit = "us/row"  # type: ignore[attr-defined]


class Repair:
    """The node lock's time per repair at a large node's table sizes (NOTE [ Holder registry ] in shm/holders.py):
    the periodic one each writer and reader runs about once a second, which finds no death almost always, and the
    one after a death (a reaped process held 64 slots). Milliseconds of lock per call, so lower is better."""

    params = ([4 * 2**20, 64 * 2**20],)
    param_names = ("slots",)
    repeat = (2, 3, 120.0)
    timeout = 900

    def setup(self, slots: int) -> None:
        self.table = table = SlotTable(slots, seed=0)
        pid = os.getpid()
        table.commit_written(pid, table.acquire_empty(pid, int(FILL * slots)))
        table.acquire_empty(pid, 2048)  # a live writer's reservation and a live reader's batch
        table.draw_full(pid, 4096)
        int(table.holder.sum()) + int(table.state.sum())  # fault every page in, as on a node that has run a while

    def teardown(self, slots: int) -> None:
        self.table.close()

    def _lock_ms(self) -> float:
        before = self.table.lock_usage().held_s
        self.table.repair()
        return round((self.table.lock_usage().held_s - before) * 1e3, 3)

    def track_lock_ms_per_periodic_repair(self, slots: int) -> float:
        return self._lock_ms()

    def track_lock_ms_per_repair_after_a_death(self, slots: int) -> float:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        self.table.acquire_empty(pid, 64)  # registered as gone: the process no longer exists
        return self._lock_ms()

    track_lock_ms_per_periodic_repair.unit = "ms"  # type: ignore[attr-defined]
    track_lock_ms_per_repair_after_a_death.unit = "ms"  # type: ignore[attr-defined]
