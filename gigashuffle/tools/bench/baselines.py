"""Baselines the loader is measured against, and the timing loop all measurements share.

* :class:`CopyFloor`: one process gathering ``bs`` random rows of the workload's layout out of a
  preallocated ``shuffle_size``-row tensor into a preallocated batch with ``torch.index_select(out=...)``.
  No IPC, no allocation, no refill: the most a single process can gather, a ceiling for any loader.
* :func:`make_dataloader`: a ``torch.utils.data.DataLoader`` with ``num_workers=2``,
  ``persistent_workers=True`` over the same repeating chunks, each worker holding its own shuffle buffer of
  ``shuffle_size / num_workers`` rows (the webdataset / torchdata model). See :class:`WorkerShuffleBuffer`
  for which variant and why.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gigashuffle.tools.bench.stamps import ChunkStamps
from gigashuffle.tools.bench.workloads import ID_FIELD, Chunk, RepeatingChunkDataset, Workload

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Rate:
    """Rows and bytes moved over a timed window."""

    samples: int
    batches: int
    seconds: float
    row_bytes: int

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.samples_per_s * self.row_bytes / 1e6

    def to_dict(self) -> dict[str, float | int]:
        return {
            "samples": self.samples,
            "batches": self.batches,
            "seconds": self.seconds,
            "row_bytes": self.row_bytes,
            "samples_per_s": self.samples_per_s,
            "mb_per_s": self.mb_per_s,
        }


def timed_batches(step: Callable[[], int], seconds: float, row_bytes: int, max_batches: int | None = None) -> Rate:
    """Call ``step`` (which returns the rows of the batch it produced) until ``seconds`` or ``max_batches``.

    At least one batch is always timed, so a slow implementation still gets a figure.
    """
    samples = batches = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        samples += step()
        batches += 1
        now = time.perf_counter()
        if now >= deadline or (max_batches is not None and batches >= max_batches):
            return Rate(samples, batches, now - start, row_bytes)


class CopyFloor:
    """Gather ``bs`` random rows from a ``shuffle_size``-row source into one preallocated batch."""

    def __init__(self, workload: Workload, seed: int = 0) -> None:
        self.workload = workload
        self.source = workload.make_rows(workload.shuffle_size, seed=seed)
        self.out = {f.name: torch.empty((workload.bs, *f.shape), dtype=f.dtype) for f in workload.all_fields}
        self._index = torch.empty(workload.bs, dtype=torch.int64)
        self._gen = torch.Generator().manual_seed(seed)

    def step(self) -> int:
        torch.randint(0, self.workload.shuffle_size, (self.workload.bs,), generator=self._gen, out=self._index)
        for name, src in self.source.items():
            torch.index_select(src, 0, self._index, out=self.out[name])
        return self.workload.bs


def copy_floor(
    workload: Workload,
    seconds: float,
    warmup_batches: int = 3,
    max_batches: int | None = None,
    threads: int | None = None,
) -> Rate:
    """The copy floor's rate; with ``threads``, torch's intra-op threads are set to that many for the run.

    The default (torch's own, one per core) lets ``index_select`` of large rows use every core, which no single
    loader process does (readers and writers run one thread each): ``threads=1`` measures what one reader's
    gather can reach at most."""
    floor = CopyFloor(workload)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        for _ in range(warmup_batches):
            floor.step()
        return timed_batches(floor.step, seconds, workload.row_bytes, max_batches)
    finally:
        torch.set_num_threads(before)


class _ChunkCursor:
    """Hands out rows of a chunk stream whose chunks are reused in place by the dataset.

    Rows of the current chunk stay valid until the next chunk is pulled, so callers copy them first.
    """

    def __init__(self, chunks: Iterator[Chunk]) -> None:
        self._chunks = chunks
        self._chunk: dict[str, torch.Tensor] = {}
        self._offset = 0
        self._rows = 0

    def take(self, rows: int) -> Iterator[tuple[dict[str, torch.Tensor], slice, slice]]:
        """Yield (chunk, rows of the chunk, positions in the request) until ``rows`` rows were handed out."""
        done = 0
        while done < rows:
            if self._offset == self._rows:
                self._chunk = next(self._chunks)[0]
                self._offset, self._rows = 0, len(self._chunk[ID_FIELD])
            n = min(rows - done, self._rows - self._offset)
            yield self._chunk, slice(self._offset, self._offset + n), slice(done, done + n)
            self._offset += n
            done += n


def _empty_batch(shape: tuple[int, ...], dtype: torch.dtype, in_worker: bool) -> torch.Tensor:
    if not in_worker:
        return torch.empty(shape, dtype=dtype)
    # The trick default_collate uses in workers: allocate the batch in shared memory from the start, so
    # sending it to the main process does not pay another copy (share_memory_() on send would copy it).
    nbytes = math.prod(shape) * dtype.itemsize
    storage: torch.UntypedStorage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


class WorkerShuffleBuffer(IterableDataset[Batch]):
    """A per-worker shuffle buffer yielding ready batches: the stronger of the two honest variants.

    Each worker keeps ``buffer_rows`` rows in one tensor per field. Per batch it picks ``bs`` distinct random
    slots, gathers them with ``index_select`` straight into a shared-memory batch, and refills those slots
    with the next ``bs`` rows of its chunk stream (``index_copy_``): emit random rows, replace them with new
    ones, as webdataset's ``shuffle`` or torchdata's ``Shuffler`` do, but batch-wise. Use it with
    ``batch_size=None`` (webdataset's recommended ``.batched()`` + ``batch_size=None`` pattern).

    The other variant, yielding per-sample dicts for ``batch_size=bs`` and default collate, does the same
    copies (gather, stack into shared memory, refill) plus per-sample Python work and a ``torch.stack`` over
    ``bs`` tensors per field, so it is strictly slower; measuring it would flatter the loader.
    """

    def __init__(self, source: RepeatingChunkDataset, buffer_rows: int, bs: int, seed: int = 0) -> None:
        super().__init__()
        if bs > buffer_rows:
            raise ValueError(f"bs={bs} exceeds the per-worker buffer of {buffer_rows} rows")
        self.source = source
        self.buffer_rows = buffer_rows
        self.bs = bs
        self.seed = seed

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        in_worker = info is not None
        rng = np.random.default_rng(self.seed + (info.id if info is not None else 0))
        fields = self.source.workload.all_fields
        buffer = {f.name: torch.empty((self.buffer_rows, *f.shape), dtype=f.dtype) for f in fields}
        cursor = _ChunkCursor(iter(self.source))
        self._refill(buffer, torch.arange(self.buffer_rows), cursor)
        while True:
            # Generator.choice without replacement is O(bs) here; torch.randperm would be O(buffer_rows).
            slots = torch.from_numpy(rng.choice(self.buffer_rows, self.bs, replace=False))
            batch = {}
            for f in fields:
                out = _empty_batch((self.bs, *f.shape), f.dtype, in_worker)
                batch[f.name] = torch.index_select(buffer[f.name], 0, slots, out=out)
            self._refill(buffer, slots, cursor)
            yield batch

    @staticmethod
    def _refill(buffer: dict[str, torch.Tensor], slots: torch.Tensor, cursor: _ChunkCursor) -> None:
        for chunk, rows, positions in cursor.take(len(slots)):
            for name, tensor in buffer.items():
                tensor.index_copy_(0, slots[positions], chunk[name][rows])


def make_dataloader(
    workload: Workload, num_workers: int = 2, seed: int = 0, stamps: ChunkStamps | None = None
) -> DataLoader[Batch]:
    """The DataLoader baseline: ``num_workers`` persistent workers, ``shuffle_size/num_workers`` rows each;
    ``stamps``: where the workers note when they pulled each chunk into their buffer."""
    buffer_rows = workload.shuffle_size // max(1, num_workers)
    source = RepeatingChunkDataset(workload, seed=seed, stamps=stamps)
    dataset = WorkerShuffleBuffer(source, buffer_rows, workload.bs, seed)
    return DataLoader(dataset, batch_size=None, num_workers=num_workers, persistent_workers=num_workers > 0)


@dataclass(frozen=True)
class DataLoaderRun:
    rate: Rate
    ids: list[np.ndarray]  # row ids of every batch read, warm-up included, in read order
    num_workers: int


def dataloader_baseline(
    workload: Workload,
    seconds: float,
    num_workers: int = 2,
    warmup_batches: int | None = None,
    max_batches: int | None = None,
    stamps: ChunkStamps | None = None,
) -> DataLoaderRun:
    """Time the DataLoader baseline once every worker has filled its buffer and prefetching is primed."""
    loader = make_dataloader(workload, num_workers, stamps=stamps)
    # Each worker fills its buffer before its first batch; two batches per worker gets past that.
    warmup = 2 * max(1, num_workers) if warmup_batches is None else warmup_batches
    ids: list[np.ndarray] = []
    batches = iter(loader)

    def step() -> int:
        batch = next(batches)
        ids.append(batch[ID_FIELD].numpy().copy())
        return len(batch[ID_FIELD])

    for _ in range(warmup):
        step()
    rate = timed_batches(step, seconds, workload.row_bytes, max_batches)
    # The workers (and their buffers) go away with the loader and its iterator when this returns.
    return DataLoaderRun(rate, ids, num_workers)
