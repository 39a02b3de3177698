"""The benchmark workloads and the dataset that feeds them.

Each workload is a row layout plus the sizes from the benchmark issue (chunk rows, batch size, shuffle size).
The dataset builds one chunk once and yields it again and again, so what is timed is the loader moving
bytes, not a dataset producing them. Every row still carries a unique ``id`` (int64) so that shuffle quality
can be measured on the rows that come out: ``id = writer_id * 2**40 + running row counter of that writer``
(:mod:`gigashuffle.tools.rowids`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle.tools.rowids import ID_FIELD, WRITER_SHIFT

if TYPE_CHECKING:
    from gigashuffle.tools.bench.stamps import ChunkStamps

__all__ = [
    "ID_FIELD", "WORKLOADS", "Chunk", "FieldSpec", "RepeatingChunkDataset", "Workload", "get_workload", "make_ids",
]  # fmt: skip

Chunk = list[dict[str, torch.Tensor]]


@dataclass(frozen=True)
class FieldSpec:
    """One field of a row: its name, dtype and per-row shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


_ID_SPEC = FieldSpec(ID_FIELD, torch.int64, ())


@dataclass(frozen=True)
class Workload:
    """A benchmark workload: the payload fields of a row and the sizes the loader runs with."""

    name: str
    fields: tuple[FieldSpec, ...]
    chunk_rows: int
    bs: int
    shuffle_size: int

    @property
    def all_fields(self) -> tuple[FieldSpec, ...]:
        """The payload fields plus ``id``: the layout every implementation under test moves."""
        return (*self.fields, _ID_SPEC)

    @property
    def row_bytes(self) -> int:
        """Bytes per row as moved (``id`` included, since all three implementations move it)."""
        return sum(field.row_bytes for field in self.all_fields)

    def make_chunk(self, rows: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
        """One chunk of random rows; ``id`` is 0..rows-1 (the dataset rewrites it per yield)."""
        rows = self.chunk_rows if rows is None else rows
        gen = torch.Generator().manual_seed(seed)
        chunk = {field.name: _random_field(field, rows, gen) for field in self.fields}
        chunk[ID_FIELD] = torch.arange(rows, dtype=torch.int64)
        return chunk

    def make_rows(self, rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
        """``rows`` rows built by tiling one chunk: content does not matter, touched pages do."""
        chunk = self.make_chunk(seed=seed)
        out = {field.name: torch.empty((rows, *field.shape), dtype=field.dtype) for field in self.all_fields}
        for start in range(0, rows, self.chunk_rows):
            stop = min(rows, start + self.chunk_rows)
            for name, tensor in out.items():
                tensor[start:stop].copy_(chunk[name][: stop - start])
        out[ID_FIELD].copy_(torch.arange(rows, dtype=torch.int64))
        return out


def _random_field(field: FieldSpec, rows: int, gen: torch.Generator) -> torch.Tensor:
    shape = (rows, *field.shape)
    if field.dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=field.dtype)
    high = 256 if field.dtype == torch.uint8 else 1000
    return torch.randint(0, high, shape, generator=gen, dtype=field.dtype)


WORKLOADS: dict[str, Workload] = {
    "image": Workload(
        "image",
        (FieldSpec("x", torch.uint8, (3, 224, 224)), FieldSpec("y", torch.int64, ())),
        chunk_rows=64,
        bs=256,
        shuffle_size=4096,
    ),
    "tokens": Workload("tokens", (FieldSpec("x", torch.int32, (2048,)),), chunk_rows=64, bs=64, shuffle_size=16384),
    "tiny": Workload(
        "tiny",
        (FieldSpec("x", torch.float32, (16,)), FieldSpec("y", torch.int64, ())),
        chunk_rows=1024,
        bs=1024,
        shuffle_size=65536,
    ),
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}") from None


def make_ids(writer_id: int, start: int, rows: int) -> torch.Tensor:
    """The ids of ``rows`` consecutive rows of one writer starting at its row ``start``."""
    return torch.arange(rows, dtype=torch.int64) + ((writer_id << WRITER_SHIFT) + start)


class RepeatingChunkDataset(IterableDataset[Chunk]):
    """Yields one prebuilt chunk forever (or ``max_chunks`` times), with fresh row ids each time.

    The chunk is reused in place: consumers must copy what they keep before asking for the next chunk, as
    a loader writer does when it copies rows into its buffer. Rewriting ``id`` costs one add per chunk.
    """

    def __init__(
        self, workload: Workload, max_chunks: int | None = None, seed: int = 0, stamps: ChunkStamps | None = None
    ) -> None:
        super().__init__()
        self.workload = workload
        self.max_chunks = max_chunks
        self.seed = seed
        self.stamps = stamps  # where each writer notes when it handed out each chunk (see .stamps)

    def __iter__(self) -> Iterator[Chunk]:
        info = get_worker_info()
        writer_id = info.id if info is not None else 0
        chunk = self.workload.make_chunk(seed=self.seed + writer_id)
        rows = self.workload.chunk_rows
        base = make_ids(writer_id, 0, rows)
        ids = chunk[ID_FIELD]
        log = self.stamps.writer_log(writer_id) if self.stamps is not None else None
        produced = 0
        while self.max_chunks is None or produced < self.max_chunks:
            torch.add(base, produced * rows, out=ids)
            if log is not None:
                log.note(produced)
            yield [chunk]
            produced += 1
