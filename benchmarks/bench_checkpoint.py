"""What a checkpoint costs (NOTE [ Checkpoint cut ] in checkpoint/cut.py) on each workload of ``gigashuffle bench``
(tiny, tokens, image, each with its own bs and shuffle_size): the latency of ``state_dict()``, the pause it imposes
on the node, the checkpoint's size, and the time to the first batch of a loader that loads it right after
construction.

One rank, 2 writers, 2 readers, on the embedded Redis (sizes small enough for a 2-core machine; for 1M tiny slots,
and a loader's first checkpoint, run ``python -m gigashuffle.tools.bench.checkpoint --shuffle-size 1048576``).
Lower is better for every figure. The loader is started and mixed in ``setup``, and its first checkpoint (which
faults the buffer into the trainer) is taken there too, so the samples are the steady state.
"""

from __future__ import annotations

import atexit
import io
import os
import secrets
import time
from collections.abc import Iterator
from typing import Any

import torch

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.checkpoint.parts import rank_key
from gigashuffle.tools.bench.checkpoint import dataset_of
from gigashuffle.tools.bench.workloads import WORKLOADS

BATCHES = 50
WORKLOAD_NAMES = ["tiny", "tokens", "image"]


def _config(queue: str, workload: str) -> DataloaderConfig:
    spec = WORKLOADS[workload]
    return DataloaderConfig(bs=spec.bs, shuffle_size=spec.shuffle_size, queue_name=queue, num_writers=2,
                            num_readers=2)  # fmt: skip


class _Running:
    """One mixed loader per workload and benchmark process, its first checkpoint taken."""

    def __init__(self, workload: str) -> None:
        self.queue = f"asv-ckpt-{os.getpid()}-{secrets.token_hex(4)}"
        self.loader = MultiprocessShuffledDataloader(dataset_of(workload), _config(self.queue, workload))
        atexit.register(self.loader.close)
        self.batches: Iterator[Any] = iter(self.loader)
        self.read()
        self.state = self.loader.state_dict()

    def read(self) -> None:
        for _ in range(BATCHES):
            next(self.batches)


_RUNNING: dict[str, _Running] = {}


def _running(workload: str) -> _Running:
    if workload not in _RUNNING:
        for other in list(_RUNNING):  # one loader at a time: an image buffer is 600 MB
            _RUNNING.pop(other).loader.close()
        _RUNNING[workload] = _Running(workload)
    return _RUNNING[workload]


class Checkpoint:
    timeout = 300.0
    params = WORKLOAD_NAMES
    param_names = ["workload"]

    def setup(self, workload: str) -> None:
        self.running = _running(workload)
        self.running.read()  # the buffer refilled and moving, as between two checkpoints

    def time_state_dict(self, workload: str) -> None:
        self.running.loader.state_dict()

    def track_cut_pause_ms(self, workload: str) -> float:
        loader = self.running.loader
        loader.state_dict()
        return 1000 * loader._checkpoints.last_cut_s  # the cut's own clock of the pause

    track_cut_pause_ms.unit = "ms"  # type: ignore[attr-defined]

    def track_writers_held_ms(self, workload: str) -> float:
        loader = self.running.loader
        loader.state_dict()
        return 1000 * loader._checkpoints.cut_parts["writers_held"]

    track_writers_held_ms.unit = "ms"  # type: ignore[attr-defined]

    def track_checkpoint_mb(self, workload: str) -> float:
        blob = io.BytesIO()
        torch.save(self.running.loader.state_dict(), blob)
        return blob.tell() / 2**20

    track_checkpoint_mb.unit = "MB"  # type: ignore[attr-defined]

    def track_saved_rows(self, workload: str) -> float:
        rows = self.running.loader.state_dict()[rank_key(0)]["rows"]
        return float(rows["count"]) if rows else 0.0

    track_saved_rows.unit = "rows"  # type: ignore[attr-defined]


class Resume:
    timeout = 300.0
    number = 1
    repeat = 3
    params = WORKLOAD_NAMES
    param_names = ["workload"]

    def setup(self, workload: str) -> None:
        # A loader of its own queue, checkpointed and closed: the resumed one below takes its place (a job resumed).
        self.queue = f"asv-resume-{os.getpid()}-{secrets.token_hex(4)}"
        with MultiprocessShuffledDataloader(dataset_of(workload), _config(self.queue, workload)) as loader:
            batches = iter(loader)
            for _ in range(BATCHES):
                next(batches)
            self.state = loader.state_dict()

    def track_first_batch_after_resume_s(self, workload: str) -> float:
        t0 = time.perf_counter()
        with MultiprocessShuffledDataloader(dataset_of(workload), _config(self.queue, workload)) as loader:
            loader.load_state_dict(self.state)
            next(iter(loader))
            return time.perf_counter() - t0

    track_first_batch_after_resume_s.unit = "s"  # type: ignore[attr-defined]
