"""``gigashuffle demo``: a real loader on the embedded default Redis over a synthetic image-like dataset."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle.config import DataloaderConfig
from gigashuffle.loader import MultiprocessShuffledDataloader
from gigashuffle.tools.quality import measure
from gigashuffle.tools.rowids import ID_FIELD, WRITER_SHIFT


class SyntheticImages(IterableDataset[list[dict[str, torch.Tensor]]]):
    """Chunks of random uint8 'images' with labels, row ids that say which writer made them (and its count), and
    the time each chunk was made."""

    def __init__(self, chunk_rows: int = 64, side: int = 64) -> None:
        self.chunk_rows = chunk_rows
        self.side = side

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        info = get_worker_info()
        writer = info.id if info is not None else 0
        generator = torch.Generator().manual_seed(writer)
        pixels = torch.randint(
            0, 256, (self.chunk_rows, 3, self.side, self.side), dtype=torch.uint8, generator=generator
        )
        counter = 0
        while True:
            ids = (writer << WRITER_SHIFT) + torch.arange(counter, counter + self.chunk_rows, dtype=torch.int64)
            counter += self.chunk_rows
            # When the chunk was made (CLOCK_MONOTONIC, one clock for every process of the machine): with it the
            # quality figure knows the order the two writers' rows entered the buffer, not just each writer's own.
            stamp = torch.full((self.chunk_rows,), time.monotonic_ns(), dtype=torch.int64)
            yield [{"image": pixels, "label": ids % 1000, ID_FIELD: ids, "written_ns": stamp}]


def _progress(loader: MultiprocessShuffledDataloader, target: int, out: TextIO) -> None:
    """Show the buffer filling until it holds ``target`` full slots: a bar redrawn in place (``\\r``) in a
    terminal; elsewhere (a pipe, a log file) a plain line now and then, which such a reader shows as written."""
    width = 40
    tty = out.isatty()
    last_line = -1.0
    while True:
        full = loader.stats().full
        done = min(full, target)
        if tty:
            bar = "#" * (width * done // target)
            out.write(f"\rfilling shuffle buffer [{bar:<{width}}] {done}/{target} slots")
        elif full >= target or time.monotonic() - last_line >= 1.0:
            out.write(f"filling shuffle buffer: {done}/{target} slots\n")
            last_line = time.monotonic()
        out.flush()
        if full >= target:
            if tty:
                out.write("\n")
            return
        time.sleep(0.1)


def run(seconds: float, queue: str, out: Any = sys.stdout) -> dict[str, float]:
    config = DataloaderConfig(
        bs=64, shuffle_size=4096, queue_name=queue, num_writers=2, num_readers=2, min_mixing=0.5, redis_url=None
    )
    t0 = time.perf_counter()
    with MultiprocessShuffledDataloader(SyntheticImages(), config) as loader:
        dummy = loader.get_dummy_batch()
        startup = time.perf_counter() - t0
        _progress(loader, config.min_full_slots, sys.stderr)
        batches: list[np.ndarray] = []
        stamps: list[np.ndarray] = []
        row_bytes = sum(t[0].numel() * t.element_size() for t in dummy[0].values())
        start = time.perf_counter()
        for batch in loader:
            batches.append(batch[0][ID_FIELD].numpy().copy())
            stamps.append(batch[0]["written_ns"].numpy().copy())
            if time.perf_counter() - start >= seconds:
                break
        elapsed = time.perf_counter() - start
        stats = loader.stats()
    rows = len(batches) * config.bs
    quality = measure(batches, config.shuffle_size, config.num_writers * config.global_world_size, stamps=stamps)
    report = {
        "startup_s": startup,
        "batches": float(len(batches)),
        "samples_per_s": rows / elapsed,
        "mb_per_s": rows * row_bytes / elapsed / 1e6,
        "displacement_ratio": quality.displacement_ratio,
        "distinct_writers_per_batch": quality.distinct_writers_per_batch,
        "duplicate_fraction": quality.duplicate_fraction,
    }
    print(f"gigashuffle demo: queue {queue!r}, embedded Redis, 2 writers + 2 readers, bs={config.bs}", file=out)
    print(f"  dummy batch after   {startup:.2f} s (start-up of the writer/reader processes)", file=out)
    print(f"  read                {len(batches)} batches ({rows} samples) in {elapsed:.1f} s", file=out)
    print(f"  throughput          {report['samples_per_s']:,.0f} samples/s, {report['mb_per_s']:,.0f} MB/s", file=out)
    print(f"  buffer at the end   full={stats.full} empty={stats.empty} in_flight={stats.in_flight}", file=out)
    print(
        f"  shuffle quality     displacement {quality.displacement:,.0f} rows vs {quality.ideal_displacement:,.0f} "
        f"for an ideal {config.shuffle_size}-slot buffer (ratio {quality.displacement_ratio:.2f}); "
        f"{quality.distinct_writers_per_batch:.2f} distinct writers per batch; "
        f"{quality.duplicate_fraction:.1%} samples read twice",
        file=out,
    )
    return report
