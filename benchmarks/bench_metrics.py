"""What ``loader.metrics()`` costs: one call, and rows/s with a call after every batch against none.

asv figures (lower is better): seconds per ``metrics()`` call on a running loader (the call a trainer makes every
batch, which hands out the last reading while it is younger than 0.1 s, and a fresh reading, ``max_age_s=0``), and
seconds per 1,000 rows read with and without a ``metrics()`` call per batch. Run as a script for the side-by-side
figure the docs quote (alternating rounds in one process, one loader, so both arms see the same machine):

    python benchmarks/bench_metrics.py --rounds 6 --batches 2000

The trainer's own counting (a batch counter, and two clock reads only when it waits) is always on; what a caller
chooses is how often to call ``metrics()``, so that is what is measured.
"""

from __future__ import annotations

import argparse
import atexit
import os
import secrets
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.tools.bench.workloads import FieldSpec, RepeatingChunkDataset, Workload

TINY = Workload("tiny-metrics", (FieldSpec("x", torch.int64, (4,)),), chunk_rows=256, bs=64, shuffle_size=16_384)
ROWS = 64_000


def _start() -> MultiprocessShuffledDataloader:
    config = DataloaderConfig(
        bs=TINY.bs, shuffle_size=TINY.shuffle_size, queue_name=f"asv-metrics-{os.getpid()}-{secrets.token_hex(4)}",
        num_writers=1, num_readers=1, min_mixing=0.5,
    )  # fmt: skip
    return MultiprocessShuffledDataloader(RepeatingChunkDataset(TINY), config)


class _Running:
    def __init__(self) -> None:
        self.loader = _start()
        atexit.register(self.loader.close)
        self.batches: Iterator[Any] = iter(self.loader)
        self.read(ROWS // 4, every_batch=False)

    def read(self, rows: int, every_batch: bool) -> float:
        started = time.perf_counter()
        metrics = self.loader.metrics
        if every_batch:
            for _ in range(rows // TINY.bs):
                next(self.batches)
                metrics()
        else:
            for _ in range(rows // TINY.bs):
                next(self.batches)
        return time.perf_counter() - started


_RUNNING: list[_Running] = []


def _running() -> _Running:
    if not _RUNNING:
        _RUNNING.append(_Running())
    return _RUNNING[0]


class MetricsCall:
    """Seconds per ``metrics()`` call on a running loader (asv times many calls)."""

    def setup(self) -> None:
        self.loader = _running().loader

    def time_metrics_call(self) -> None:
        self.loader.metrics()

    def time_metrics_fresh_reading(self) -> None:
        self.loader.metrics(max_age_s=0)


class RowsWithAndWithoutMetrics:
    """Seconds per 1,000 rows read, without and with a ``metrics()`` call after every batch."""

    number = 1
    repeat = 3
    timeout = 300

    def setup(self) -> None:
        self.running = _running()

    def track_s_per_1000_rows_without_metrics(self) -> float:
        return self.running.read(ROWS, every_batch=False) * 1000 / ROWS

    def track_s_per_1000_rows_with_metrics_every_batch(self) -> float:
        return self.running.read(ROWS, every_batch=True) * 1000 / ROWS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--calls", type=int, default=20000, help="metrics() calls timed back to back")
    args = parser.parse_args()
    running = _running()
    rows = args.batches * TINY.bs
    without, with_ = [], []
    for _ in range(args.rounds):  # alternate, so that load on the machine falls on both arms alike
        without.append(rows / running.read(rows, every_batch=False))
        with_.append(rows / running.read(rows, every_batch=True))
    loader = running.loader
    started = time.perf_counter()
    for _ in range(args.calls):
        loader.metrics()
    call_s = (time.perf_counter() - started) / args.calls
    started = time.perf_counter()
    for _ in range(args.calls):
        loader.metrics(max_age_s=0)
    fresh_s = (time.perf_counter() - started) / args.calls
    med_without, med_with = statistics.median(without), statistics.median(with_)
    print(f"rows/s without metrics(): median {med_without:,.0f}  rounds {[f'{r:,.0f}' for r in without]}")
    print(f"rows/s with metrics() every batch: median {med_with:,.0f}  rounds {[f'{r:,.0f}' for r in with_]}")
    print(f"ratio with/without: {med_with / med_without:.3f}")
    print(f"one metrics() call, back to back (the last reading while fresh): {call_s * 1e6:.2f} us")
    print(f"one fresh reading, metrics(max_age_s=0): {fresh_s * 1e6:.1f} us")
    loader.close()


if __name__ == "__main__":
    main()
