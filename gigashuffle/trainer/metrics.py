"""``loader.metrics()``: counters and gauges of one rank's loader, read without the node lock.

NOTE [ Metrics ]
Every figure comes from a counter that is already kept: the trainer counts its batches and the time it waited for
one (two ``time.monotonic()`` calls, only when it waits); each writer and reader adds to its page of shared
counters once per chunk or draw (NOTE [ Child counters ] in shm/counters.py); the node lock's hold time, the
rows written and the fill are words of the slot table's header; the device copies' time is the placement's two
running sums (trainer/pinning.py). A reading takes them all, without the lock and
without Redis, and turns the change since the previous reading (the first: since the loader was built) into rates
and shares; it costs about 20 us (every child's page, the table's header, a few dozen float operations).
``metrics()`` is meant to be callable after every batch: it makes a reading only when the last one is at least
``max_age_s`` old (0.1 s by default) and otherwise returns that last reading, unchanged (one clock read, well under
a microsecond). So every figure of a ``LoaderMetrics``, totals included, is as of its ``taken_at`` (at most
``max_age_s`` before the call), and its rates are over its ``interval_s`` (at least ``max_age_s`` when called often;
the caller's own interval when called less often). ``metrics(max_age_s=0)`` always reads afresh.
Reading the rule (docs/waiting-on-data.md): a high ``wait_share`` with writers mostly ``in_dataset`` is a slow
source; with ``lock_busy_share`` near 1, the node is lock-bound; a ``wait_share`` near 0 means the trainer (the
GPU) is the bound, and the writers then show ``blocked`` on a full buffer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gigashuffle import promtext
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.shm import counters as cc
from gigashuffle.shm.slottable import SlotTable

# metrics() hands out its last reading while it is younger than this (NOTE [ Metrics ]): a reading costs about
# 20 us, so one per 0.1 s is 0.02% of a trainer's time however often it is called.
METRICS_MAX_AGE_S = 0.1


@dataclass(frozen=True)
class WriterMetrics:
    """One writer over the interval: rows/s it copied in, and the shares of its time inside the dataset (waiting
    for its next chunk) and blocked on a full buffer; the rest is copying rows and taking the node lock."""

    index: int
    pid: int | None
    rows: int
    rows_per_s: float
    in_dataset: float
    blocked: float


@dataclass(frozen=True)
class LoaderMetrics:
    """One rank's loader; totals since it was built, rates and shares over ``interval_s`` (NOTE [ Metrics ])."""

    queue: str
    rank: int
    interval_s: float
    batches: int
    wait_s: float
    wait_share: float  # of the interval, the trainer waited for a batch
    wait_per_batch_s: float  # over the interval
    rows_per_s: float  # delivered to this trainer
    writers: tuple[WriterMetrics, ...]
    gather_per_batch_s: float  # a reader's copy of one batch out of the buffer
    readers_starved: float  # share of the readers' time with too few full slots to draw (below min_mixing)
    fill_mean: float  # full slots as a share of shuffle_size, at the readers' draws
    fill_min: float
    fill_samples: int  # readers' draws that sampled the fill; 0: both figures were sampled once, at the call
    row_age_rows: float  # rows written on the node between a row's write and its draw
    row_age_s: float  # the same in seconds, at the node's current write rate
    node_rows_per_s: float  # written into the node's buffer by every writer of the node
    lock_busy_share: float  # of the interval, the node's slot-table lock was held
    restarts: int
    writers_per_batch: float = math.nan  # distinct writers (processes of the node) among a batch's rows, mean
    h2d_per_batch_s: float | None = None  # the trainer's time making one batch's device copy; None: no device
    taken_at: float = math.nan  # time.monotonic() of the reading: every figure is as of then

    def to_prometheus(self, prefix: str = "gigashuffle") -> str:
        """The figures in the Prometheus text exposition format (version 0.0.4), labelled by queue and rank."""
        return render_prometheus(self, prefix)


@dataclass
class _Seen:
    """What the previous ``metrics()`` call read, to take differences from."""

    at: float
    batches: int = 0
    wait_s: float = 0.0
    children: dict[int, np.ndarray[Any, np.dtype[np.float64]]] = field(default_factory=dict)  # pid -> cells
    lock_held_s: float = 0.0
    written: int = 0
    h2d_s: float = 0.0
    h2d_copies: int = 0


class MetricsReader:
    """Keeps the trainer's own counters and turns every counter into a ``LoaderMetrics``."""

    def __init__(self, queue: str, rank: int, shuffle_size: int, bs: int) -> None:
        self.queue, self.rank, self.shuffle_size, self.bs = queue, rank, shuffle_size, bs
        self.batches = 0  # delivered to the caller
        self.wait_s = 0.0  # the caller waited for a batch (Batches._wait_for_batch in trainer/batches.py)
        self._seen = _Seen(at=time.monotonic())
        self.last: LoaderMetrics | None = None  # the last reading, which metrics() hands out while it is fresh

    def fresh(self, max_age_s: float) -> LoaderMetrics | None:
        """The last reading if it is less than ``max_age_s`` old (the per-batch path of ``metrics()``)."""
        last = self.last
        if last is not None and time.monotonic() - last.taken_at < max_age_s:
            return last
        return None

    def read(
        self,
        children: list[ChildProcess],
        table: SlotTable | None,
        restarts: int,
        h2d: tuple[float, int] | None = None,
    ) -> LoaderMetrics:
        """A fresh reading. ``h2d``: the placement's device-copy seconds and count so far (None: no device)."""
        now = time.monotonic()
        seen = self._seen
        dt = max(now - seen.at, 1e-9)
        batches, wait_s = self.batches - seen.batches, self.wait_s - seen.wait_s
        cells = {c.pid: c.counters.read() for c in children if c.alive and c.counters is not None and c.pid}
        writers = tuple(_writer(c, cells[c.pid], seen, now) for c in children if c.role == "writer" and c.pid in cells)
        readers = [(cells[c.pid], seen.children.get(c.pid)) for c in children if c.role == "reader" and c.pid in cells]
        gather, starved, fill_mean, fill_min, age_rows, fill_samples, per_batch = _readers(readers, now, seen.at)
        fill_mean, fill_min = fill_mean / self.shuffle_size, fill_min / self.shuffle_size
        lock_s, written = 0.0, 0
        if table is not None:
            written, _read, slots = table.counts()
            lock_s = table.lock_usage().held_s
            if math.isnan(fill_mean):  # no draw in the interval (readers idle behind a slow trainer): sample now
                fill_mean = fill_min = slots.full / self.shuffle_size
        node_rate = (written - seen.written) / dt
        for c in children:
            if c.role == "reader" and c.pid in cells and c.counters is not None:
                c.counters.cells[cc.R_FILL_RESET] = 1.0  # the next interval's minimum starts afresh
        h2d_s, h2d_copies = h2d or (0.0, 0)
        copies = h2d_copies - seen.h2d_copies
        h2d_per_batch = None if h2d is None else (h2d_s - seen.h2d_s) / copies if copies else math.nan
        self._seen = _Seen(now, self.batches, self.wait_s, cells, lock_s, written, h2d_s, h2d_copies)
        self.last = LoaderMetrics(
            queue=self.queue,
            rank=self.rank,
            interval_s=dt,
            batches=self.batches,
            wait_s=self.wait_s,
            wait_share=min(wait_s / dt, 1.0),
            wait_per_batch_s=wait_s / batches if batches else math.nan,
            rows_per_s=batches * self.bs / dt,
            writers=writers,
            gather_per_batch_s=gather,
            readers_starved=starved,
            fill_mean=fill_mean,
            fill_min=fill_min,
            fill_samples=fill_samples,
            row_age_rows=age_rows,
            row_age_s=age_rows / node_rate if node_rate > 0 else math.nan,
            node_rows_per_s=node_rate,
            lock_busy_share=min((lock_s - seen.lock_held_s) / dt, 1.0),
            restarts=restarts,
            writers_per_batch=per_batch,
            h2d_per_batch_s=h2d_per_batch,
            taken_at=now,
        )
        return self.last


def _writer(child: ChildProcess, now_cells: np.ndarray[Any, Any], seen: _Seen, now: float) -> WriterMetrics:
    before = seen.children.get(child.pid or 0)
    if before is None:  # started since the last reading: from its own start
        before = np.zeros_like(now_cells)
        since = float(now_cells[cc.W_STARTED])
    else:
        since = seen.at
    span = max(now - since, 1e-9)
    delta = now_cells - before
    return WriterMetrics(
        index=child.index,
        pid=child.pid,
        rows=int(now_cells[cc.W_ROWS]),
        rows_per_s=float(delta[cc.W_ROWS]) / span,
        in_dataset=min(float(delta[cc.W_DATASET_S]) / span, 1.0),
        blocked=min(float(delta[cc.W_BLOCKED_S]) / span, 1.0),
    )


def _readers(
    readers: list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None]], now: float, at: float
) -> tuple[float, float, float, float, float, int, float]:
    """Gather seconds per batch, starved share, mean and least full-slot count at the draws, row age in rows, how
    many draws sampled the fill, and the mean distinct writers of the sampled batches."""
    batches = gather = starved = span = fill_sum = fill_n = age_sum = age_n = writers_sum = writers_n = 0.0
    fill_min = math.inf
    for cells, before in readers:
        # A reader started since the last reading counts from its own start.
        delta, since = (cells, cells[cc.R_STARTED]) if before is None else (cells - before, at)
        batches += delta[cc.R_BATCHES]
        gather += delta[cc.R_GATHER_S]
        starved += delta[cc.R_STARVED_S]
        span += max(now - since, 1e-9)
        fill_sum += delta[cc.R_FILL_SUM]
        fill_n += delta[cc.R_FILL_N]
        age_sum += delta[cc.R_AGE_SUM]
        age_n += delta[cc.R_AGE_N]
        writers_sum += delta[cc.R_WRITERS_SUM]
        writers_n += delta[cc.R_WRITERS_N]
        if delta[cc.R_FILL_N] > 0:
            fill_min = min(fill_min, cells[cc.R_FILL_MIN])
    return (
        float(gather / batches) if batches else math.nan,
        float(min(starved / span, 1.0)) if span else math.nan,
        float(fill_sum / fill_n) if fill_n else math.nan,
        float(fill_min) if fill_n else math.nan,
        float(age_sum / age_n) if age_n else math.nan,
        int(fill_n),
        float(writers_sum / writers_n) if writers_n else math.nan,
    )


_HELP = {
    "batches_total": ("counter", "batches delivered to this trainer"),
    "wait_seconds_total": ("counter", "seconds this trainer waited for a batch"),
    "wait_share": ("gauge", "share of the interval this trainer waited for a batch"),
    "wait_per_batch_seconds": ("gauge", "mean wait per batch over the interval"),
    "rows_per_second": ("gauge", "rows delivered to this trainer per second"),
    "gather_per_batch_seconds": ("gauge", "a reader's copy of one batch out of the buffer"),
    "readers_starved_share": ("gauge", "share of the readers' time below the mixing threshold"),
    "buffer_fill_mean": ("gauge", "full slots as a share of shuffle_size, mean at the readers' draws"),
    "buffer_fill_min": ("gauge", "full slots as a share of shuffle_size, least at the readers' draws"),
    "row_age_rows": ("gauge", "rows written on the node between a row's write and its draw"),
    "row_age_seconds": ("gauge", "a row's age at its draw at the node's write rate"),
    "node_rows_per_second": ("gauge", "rows written into the node's buffer per second"),
    "lock_busy_share": ("gauge", "share of the interval the node's slot-table lock was held"),
    "restarts_total": ("counter", "children started again after a death"),
    "writers_per_batch": ("gauge", "distinct writers among a batch's rows, mean over sampled batches"),
    "h2d_per_batch_seconds": ("gauge", "the trainer's time making one batch's host-to-device copy"),
    "writer_rows_per_second": ("gauge", "rows one writer copied into the buffer per second"),
    "writer_in_dataset_share": ("gauge", "share of a writer's time inside the dataset"),
    "writer_blocked_share": ("gauge", "share of a writer's time blocked on a full buffer"),
}


def render_prometheus(m: LoaderMetrics, prefix: str) -> str:
    base = {"queue": m.queue, "rank": m.rank}
    plain: dict[str, float] = {
        "batches_total": m.batches,
        "wait_seconds_total": m.wait_s,
        "wait_share": m.wait_share,
        "wait_per_batch_seconds": m.wait_per_batch_s,
        "rows_per_second": m.rows_per_s,
        "gather_per_batch_seconds": m.gather_per_batch_s,
        "readers_starved_share": m.readers_starved,
        "buffer_fill_mean": m.fill_mean,
        "buffer_fill_min": m.fill_min,
        "row_age_rows": m.row_age_rows,
        "row_age_seconds": m.row_age_s,
        "node_rows_per_second": m.node_rows_per_s,
        "lock_busy_share": m.lock_busy_share,
        "restarts_total": m.restarts,
        "writers_per_batch": m.writers_per_batch,
    }
    if m.h2d_per_batch_s is not None:  # no device: no such series, rather than a NaN that reads as "unknown"
        plain["h2d_per_batch_seconds"] = m.h2d_per_batch_s
    lines: list[str] = []
    for name, x in plain.items():
        lines += promtext.family(f"{prefix}_{name}", *_HELP[name], [(base, x)])
    per_writer = {
        "writer_rows_per_second": "rows_per_s",
        "writer_in_dataset_share": "in_dataset",
        "writer_blocked_share": "blocked",
    }
    for name, attribute in per_writer.items():
        samples = [({**base, "writer": w.index}, getattr(w, attribute)) for w in m.writers]
        lines += promtext.family(f"{prefix}_{name}", *_HELP[name], samples)
    return "\n".join(lines) + "\n"
