"""The whole loader, end to end, on a small workload: start-up, read time, CPU, Redis traffic and memory.

Every figure falls when the loader gets better (asv assumes lower is better): seconds to the dummy batch,
seconds per 1,000 rows read, CPU microseconds per row over all of the loader's processes, Redis commands per
1,000 rows, and the peak resident memory of its largest child. One writer and one reader on the embedded Redis,
32x32 RGB rows, so a run stays in seconds on a 2-core machine. Each benchmark measures only its own figure; those
that read from a running loader share one per benchmark process, started (and mixed) in ``setup`` before any
sample is taken.
"""

from __future__ import annotations

import atexit
import itertools
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.procs.zygotereuse import PARKING
from gigashuffle.tools.bench.runner import redis_command_calls
from gigashuffle.tools.bench.workloads import FieldSpec, RepeatingChunkDataset, Workload

SMALL = Workload(
    "small",
    (FieldSpec("x", torch.uint8, (3, 32, 32)), FieldSpec("y", torch.int64, ())),
    chunk_rows=64,
    bs=50,  # 20 batches are exactly 1,000 rows
    shuffle_size=2_048,
)
ROWS = 1_000
CPU_ROWS = 20_000  # enough rows that the CPU-time clock's resolution (10 ms) is under 1% of what is measured

Batch = list[dict[str, torch.Tensor]]


def _config() -> DataloaderConfig:
    return DataloaderConfig(
        bs=SMALL.bs,
        shuffle_size=SMALL.shuffle_size,
        queue_name=f"asv-{os.getpid()}-{secrets.token_hex(4)}",
        num_writers=1,
        num_readers=1,
        min_mixing=0.5,
    )


def _start() -> MultiprocessShuffledDataloader:
    return MultiprocessShuffledDataloader(RepeatingChunkDataset(SMALL), _config())


class _Running:
    """One mixed loader per benchmark process, for the benchmarks that measure a loader at work."""

    def __init__(self) -> None:
        self.loader = _start()
        atexit.register(self.loader.close)
        self.batches: Iterator[Batch] = iter(self.loader)
        self.read(ROWS)  # the first batch waits for min_mixing: past this, reads are steady

    def read(self, rows: int) -> None:
        for _ in range(rows // SMALL.bs):
            next(self.batches)  # dropped at once, so its ring slot is free again, as after a training step


_RUNNING: list[_Running] = []


def _running() -> _Running:
    if not _RUNNING:
        _RUNNING.append(_Running())
    return _RUNNING[0]


def _loader_processes() -> list[psutil.Process]:
    """This process and every process under it: zygote, writers, readers and the embedded Redis server."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        times = process.cpu_times()
        total += times.user + times.system
    return total


def _peak_rss_bytes(pid: int) -> int:
    """``VmHWM``: the most resident memory the process ever had (psutil reports only the current figure)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM line")


class StartUp:
    """Seconds from constructing a loader to its dummy batch: the zygote, the children, the buffer, Redis. The
    process's first loader starts a zygote; a later one takes the zygote the last one closed parked (NOTE [ Reused
    zygotes ] in procs/zygotereuse.py)."""

    repeat = (3, 8, 60.0)
    number = 1
    warmup_time = 0.0  # a warm-up would be another start-up: each sample is already a cold one
    timeout = 600
    params = ["first", "later"]
    param_names = ["loader"]

    def setup(self, loader: str) -> None:
        self.loader: MultiprocessShuffledDataloader | None = None
        PARKING.end_parked()
        if loader == "later":
            _start().close()

    def time_startup_to_dummy_batch(self, loader: str) -> None:
        self.loader = _start()
        self.loader.get_dummy_batch()

    def teardown(self, loader: str) -> None:
        if self.loader is not None:
            self.loader.close()


class Read:
    """Seconds per 1,000 rows taken from a running, mixed loader."""

    repeat = (10, 60, 20.0)
    warmup_time = 0.5
    timeout = 600

    def setup(self) -> None:
        self.running = _running()

    def time_read_1000_rows(self) -> None:
        self.running.read(ROWS)


class Cost:
    """What a row costs a running loader: CPU time over all of its processes, and the memory of its children."""

    timeout = 600

    def setup(self) -> None:
        self.running = _running()

    def track_cpu_us_per_row(self) -> float:
        processes = _loader_processes()
        before = _cpu_seconds(processes)
        self.running.read(CPU_ROWS)
        return round((_cpu_seconds(processes) - before) * 1e6 / CPU_ROWS, 3)

    track_cpu_us_per_row.unit = "us/row"  # type: ignore[attr-defined]

    def track_peak_rss_largest_child(self) -> float:
        self.running.read(ROWS)
        children = itertools.chain.from_iterable(self.running.loader.child_pids().values())
        return float(max(_peak_rss_bytes(pid) for pid in children))

    track_peak_rss_largest_child.unit = "bytes"  # type: ignore[attr-defined]

    def track_redis_commands_per_1000_rows(self) -> float:
        # Every command is a round trip for some process of the node: small rows are bound by them.
        client = self.running.loader.redis_client()
        before = redis_command_calls(client)
        self.running.read(CPU_ROWS)
        # The INFO that took `before` is counted in the second reading: take it off.
        return round((redis_command_calls(client) - before - 1) * ROWS / CPU_ROWS, 2)

    track_redis_commands_per_1000_rows.unit = "commands"  # type: ignore[attr-defined]

    def track_node_lock_busy_pct(self) -> float:
        # The share of the window in which the node's transitions held its slot-table lock: the bound on a node's
        # rate of small rows whatever its cores (NOTE [ Node lock budget ] in shm/slottable.py).
        loader = self.running.loader
        before, started = loader.lock_usage(), time.perf_counter()
        self.running.read(CPU_ROWS)
        held_s = loader.lock_usage().held_s - before.held_s
        return round(100 * held_s / (time.perf_counter() - started), 1)

    track_node_lock_busy_pct.unit = "%"  # type: ignore[attr-defined]
