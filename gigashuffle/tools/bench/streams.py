"""The rows one implementation delivered in a bench run, with their write times, and their shuffle quality.

Apart from :mod:`.stamps` (which the workloads' dataset writes into) so that no module of the bench imports one
that imports it back: rowids <- stamps <- workloads <- streams, and rowids <- quality <- streams.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from gigashuffle.tools import quality
from gigashuffle.tools.bench.stamps import ChunkStamps
from gigashuffle.tools.bench.workloads import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stream:
    """The rows one implementation delivered, per batch in read order, and their write times (None: unknown)."""

    batches: list[npt.NDArray[np.int64]]
    stamps: npt.NDArray[np.int64] | None
    writers: int

    @property
    def rows(self) -> int:
        return sum(len(b) for b in self.batches)


def read_stream(workload: Workload, ids: list[npt.NDArray[np.int64]], writers: int, stamps: ChunkStamps) -> Stream:
    """The rows read (``ids`` per batch) with their writers' chunk times, read now: the stamp files go away with
    their run."""
    row_stamps = stamps.row_stamps(np.concatenate(ids), workload.chunk_rows) if ids else None
    if row_stamps is None and ids:
        log.warning("%s: rows without a write time; quality estimates write order from each writer's share",
                    workload.name)  # fmt: skip
    return Stream(ids, row_stamps, writers)


def measure_quality(workload: Workload, stream: Stream, rows: int | None = None) -> dict[str, Any]:
    """Quality figures of the first ``rows`` rows of ``stream`` (whole batches; default all), placed in the write
    stream by their writers' chunk times when every row has one; else estimated from each writer's share, and
    said so. Implementations compared over the same number of rows share one ideal (NOTE [ One ideal ])."""
    batches, taken = [], 0
    for batch in stream.batches:
        if rows is not None and taken + len(batch) > rows:
            break
        batches.append(batch)
        taken += len(batch)
    row_stamps = None if stream.stamps is None else [stream.stamps[:taken]]
    figures = quality.measure(batches, workload.shuffle_size, stream.writers, stamps=row_stamps)
    return {**figures.to_dict(), "write_order": "estimated" if stream.stamps is None else "stamped"}
