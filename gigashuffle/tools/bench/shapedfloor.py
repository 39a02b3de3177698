"""The copy floor in the loader's shape: as many processes as the loader runs, doing only its unavoidable work.

:class:`.baselines.CopyFloor` is one process gathering rows: a ceiling for one reader, but it says nothing about
what a machine loses when it runs more processes than it has cores. This floor runs the loader's process graph
with none of the loader's bookkeeping (no slot table, no node lock, no Redis, no pickled messages):

* ``writers * ranks`` writers, each putting a hot chunk of ``chunk_rows`` rows into random rows of one shared
  ``shuffle_size``-row buffer (one memfd per field, rows as whole-row elements as in :mod:`gigashuffle.shm.buffer`),
  never more rows in all than the readers took out plus the buffer's free share (the loader writes one row per
  row read, into empty slots; a writer ahead of the readers waits, as the loader's does);
* ``readers * ranks`` readers, each gathering ``bs`` random rows per field into a ring slot of its own (the
  loader's ring depth) and handing the slot's number to its rank's trainer over a pipe;
* ``ranks`` trainers, each taking its readers' batches, reading the batch's first id, and handing the slot back.

Rows per second are the trainers' rows over the window; CPU per delivered row is split by role as in the
loader's figures. Side by side with the loader at the same ``--writers/--readers/--ranks``, the floor's ratio
between shapes says how much a shape can gain or lose on this machine at all, whatever the loader does.
"""

from __future__ import annotations

import logging
import mmap
import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import ring_depth_for, row_elements
from gigashuffle.tools.bench.ranks import MIN_MIXING
from gigashuffle.tools.bench.workloads import Workload

log = logging.getLogger(__name__)

# A writer that finds the writers writers_lead() rows ahead of the readers sleeps this long before it looks again.
_WRITER_WAIT_S = 0.0005
_TRAINER_POLL_S = 0.05


@dataclass(frozen=True)
class Shape:
    """The loader's process graph: ``writers`` and ``readers`` per rank, ``ranks`` trainers on one node."""

    writers: int = 1
    readers: int = 1
    ranks: int = 1


class _Shared:
    """The shared memory the floor's processes fork with: the buffer, the rings and the rows counters."""

    def __init__(self, workload: Workload, shape: Shape) -> None:
        bs, depth = workload.bs, ring_depth(workload)
        self.depth = depth
        self.readers = shape.readers * shape.ranks
        self.writers = shape.writers * shape.ranks
        self.rows = [_shared_rows(workload.shuffle_size, f.row_bytes) for f in workload.all_fields]
        self.rings = [
            [_shared_rows(depth * bs, f.row_bytes).reshape(depth, bs) for f in workload.all_fields]
            for _ in range(self.readers)
        ]
        # One cell per process, written by it alone: rows read by each reader, rows written by each writer.
        self.counts = _shared_array(self.readers + self.writers, np.dtype(np.int64))

    def rows_read(self) -> int:
        return int(self.counts[: self.readers].sum())

    def rows_written(self) -> int:
        return int(self.counts[self.readers :].sum())


def ring_depth(workload: Workload) -> int:
    """The ring depth the loader picks for this workload by default (NOTE [ Ring depth ] in shm/ring.py)."""
    return ring_depth_for(None, Layout.from_chunk([workload.make_chunk(1)]), workload.bs)


def writers_lead(workload: Workload) -> int:
    """How many rows the writers together may write beyond what the readers took out before one waits: the buffer's
    share above ``min_mixing``, which the loader's writers fill while its readers wait for mixing."""
    return workload.shuffle_size - int(workload.shuffle_size * MIN_MIXING)


def _shared_array(n: int, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    fd = os.memfd_create("gigashuffle-bench-floor", os.MFD_CLOEXEC)
    try:
        nbytes = max(1, n * dtype.itemsize)
        os.ftruncate(fd, nbytes)
        return np.frombuffer(mmap.mmap(fd, nbytes), dtype=dtype, count=n)
    finally:
        os.close(fd)  # the mapping keeps the memory; forked children inherit the mapping


def _shared_rows(n: int, row_bytes: int) -> np.ndarray[Any, Any]:
    """``n`` rows as whole-row elements, the form the loader's buffer copies them in (NOTE [ Row copies ])."""
    rows = _shared_array(n * row_bytes, np.dtype(np.uint8))
    rows[:] = 1  # touched once by the parent, as the loader's writers fill its buffer before the window
    return row_elements(rows.reshape(n, row_bytes))


@dataclass(frozen=True)
class FloorRun:
    """What the shaped floor did over ``seconds``, by role: rows (the trainers': rows delivered) and CPU seconds."""

    shape: Shape
    seconds: float
    rows_by_role: dict[str, int]
    cpu_s: dict[str, float]

    @property
    def rows(self) -> int:
        return self.rows_by_role["trainer"]

    @property
    def samples_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        per_row = {role: 1e6 * spent / self.rows for role, spent in self.cpu_s.items()} if self.rows else {}
        per_row["all"] = sum(per_row.values())
        return {
            "writers": self.shape.writers,
            "readers": self.shape.readers,
            "ranks": self.shape.ranks,
            "samples": self.rows,
            "seconds": self.seconds,
            "samples_per_s": self.samples_per_s,
            "cpu_us_per_row": per_row,
        }


Job = Callable[[float], int]  # runs until the deadline (time.monotonic()), returns its rows


def shaped_floor(workload: Workload, seconds: float, shape: Shape) -> FloorRun:
    """Run the floor's processes for ``seconds`` (all start together) and collect what they did."""
    shared = _Shared(workload, shape)
    # One pair of pipes per reader: ring slots to its trainer, and back.
    to_trainer = [os.pipe() for _ in range(shared.readers)]
    to_reader = [os.pipe() for _ in range(shared.readers)]
    jobs: list[tuple[str, Job]] = [("writer", partial(_write, workload, shared, i)) for i in range(shared.writers)]
    for i in range(shared.readers):
        jobs.append(("reader", partial(_read, workload, shared, i, to_trainer[i][1], to_reader[i][0])))
    for rank in range(shape.ranks):
        links = {
            to_trainer[i][0]: (i, to_reader[i][1]) for i in range(rank * shape.readers, (rank + 1) * shape.readers)
        }
        jobs.append(("trainer", partial(_train, workload, shared, links)))
    pipes = [fd for pair in (*to_trainer, *to_reader) for fd in pair]
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pids = [_fork(role, job, seconds, go_r, done_w) for role, job in jobs]
    for fd in (*pipes, go_r, done_w):
        os.close(fd)
    try:
        os.write(go_w, b"g" * len(pids))  # every process starts its window at once
        report = _read_all(done_r)
    finally:
        os.close(go_w)
        os.close(done_r)
        for pid in pids:
            os.waitpid(pid, 0)
    lines = report.splitlines()
    if len(lines) != len(pids):
        raise RuntimeError(f"shaped floor: {len(pids)} processes started, {len(lines)} reported")
    rows = dict.fromkeys(("writer", "reader", "trainer"), 0)
    cpu_s = dict.fromkeys(rows, 0.0)
    for line in lines:
        role, n, spent = line.split()
        rows[role] += int(n)
        cpu_s[role] += float(spent)
    return FloorRun(shape, seconds, rows, cpu_s)


def _fork(role: str, job: Job, seconds: float, go_r: int, done_w: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.read(go_r, 1)
        start = time.process_time()
        rows = job(time.monotonic() + seconds)
        os.write(done_w, f"{role} {rows} {time.process_time() - start}\n".encode())
        code = 0
    except BaseException:  # logged here: the os._exit below would end the child before Python printed it
        log.exception("shaped floor: a %s failed", role)
    finally:
        os._exit(code)


def _read_all(fd: int) -> str:
    parts = []
    while chunk := os.read(fd, 1 << 16):
        parts.append(chunk)
    return b"".join(parts).decode()


def _write(workload: Workload, shared: _Shared, i: int, deadline: float) -> int:
    rng = np.random.default_rng(1000 + i)
    n, slots = workload.chunk_rows, workload.shuffle_size
    chunk = [np.frombuffer(rng.bytes(n * rows.itemsize), dtype=rows.dtype) for rows in shared.rows]
    lead = writers_lead(workload)
    cell = shared.readers + i
    written = 0
    while time.monotonic() < deadline:
        if shared.rows_written() - shared.rows_read() > lead:
            time.sleep(_WRITER_WAIT_S)
            continue
        ids = rng.integers(0, slots, n)
        for rows, src in zip(shared.rows, chunk, strict=True):
            rows.put(ids, src)
        written += n
        shared.counts[cell] = written
    return written


def _read(workload: Workload, shared: _Shared, i: int, to_trainer: int, from_trainer: int, deadline: float) -> int:
    rng = np.random.default_rng(2000 + i)
    bs, slots = workload.bs, workload.shuffle_size
    free = list(range(shared.depth))
    rings = shared.rings[i]
    read = 0
    while time.monotonic() < deadline:
        if not free:  # every ring slot is with the trainer: wait for one, as a reader does
            if select.select([from_trainer], [], [], _TRAINER_POLL_S)[0]:
                free.extend(os.read(from_trainer, 256))
            continue
        k = free.pop()
        ids = rng.integers(0, slots, bs)
        for rows, ring in zip(shared.rows, rings, strict=True):
            rows.take(ids, out=ring[k], mode="clip")  # as SlotBuffer.gather takes them
        read += bs
        shared.counts[i] = read
        os.write(to_trainer, bytes([k]))
        if select.select([from_trainer], [], [], 0)[0]:
            free.extend(os.read(from_trainer, 256))
    return read


def _train(workload: Workload, shared: _Shared, links: dict[int, tuple[int, int]], deadline: float) -> int:
    delivered = 0
    while time.monotonic() < deadline:
        for fd in select.select(list(links), [], [], _TRAINER_POLL_S)[0]:
            reader, back = links[fd]
            ks = os.read(fd, 256)
            for k in ks:
                _ = shared.rings[reader][-1][k][0]  # the batch's first id, as a trainer looks at its batch
            delivered += workload.bs * len(ks)
            os.write(back, ks)
    return delivered
