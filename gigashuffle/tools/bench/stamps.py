"""When each writer of a benchmark produced each of its chunks: the write order that row ids alone do not tell.

A bench row id is ``writer << WRITER_SHIFT | counter`` (:mod:`gigashuffle.tools.rowids`): it says which writer wrote
a row and in what order that writer wrote its own rows, but not how the writers interleaved. Estimated from each
writer's share (:func:`gigashuffle.tools.quality.write_positions`), the interleaving is wrong whenever the writers'
rates vary over time, as they do on a machine with fewer cores than processes: in one run of two writers and two
readers on two cores, tiny rows got a displacement ratio of 2.31 from the estimate ("better mixed than an ideal
buffer") and 0.75 from these stamps. With one writer the two give the same figure.

So each writer notes ``time.monotonic_ns()`` (one clock for every process of the machine) as it hands out chunk
``k``, in slot ``k`` of a file of its own under a directory the bench owns; afterwards the rows read get their
chunk's time, and :func:`gigashuffle.tools.quality.write_positions_from_stamps` places them in the combined write
stream. A note costs one clock read and one store per chunk (64 to 1,024 rows), in the writer, outside the loader's
code.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from gigashuffle.tools.rowids import split_ids

log = logging.getLogger(__name__)

# Chunks noted per writer at most: 32 MiB of file, of which only the pages written take memory. At tiny rows'
# 1,024-row chunks this is 4e9 rows, minutes of any workload; rows of later chunks get no stamp (see row_stamps).
MAX_CHUNKS = 1 << 22


class ChunkStamps:
    """The per-writer chunk times of one bench run, in files under ``directory`` (which the caller owns)."""

    def __init__(self, directory: str | os.PathLike[str], max_chunks: int = MAX_CHUNKS) -> None:
        self.directory = str(directory)
        self.max_chunks = max_chunks

    def _path(self, writer_id: int) -> Path:
        return Path(self.directory) / f"writer-{writer_id}.i64"

    def writer_log(self, writer_id: int) -> ChunkLog:
        """The log a writer notes its chunks in (called in the writer's process)."""
        return ChunkLog(self._path(writer_id), self.max_chunks)

    def row_stamps(self, ids: npt.NDArray[np.int64], chunk_rows: int) -> npt.NDArray[np.int64] | None:
        """The time each row's chunk was handed out, or None if a row's writer noted no time for it."""
        writers, counters = split_ids(ids)
        chunks = counters // chunk_rows
        stamps = np.zeros(ids.size, dtype=np.int64)
        for writer in np.unique(writers):
            path = self._path(int(writer))
            if not path.exists():
                return None
            mine = writers == writer
            wanted = chunks[mine]
            # Only the slots up to the last chunk read, not the whole (mostly unwritten) log.
            times = np.fromfile(path, dtype=np.int64, count=int(wanted.max()) + 1)
            if int(wanted.max()) >= times.size:
                return None
            stamps[mine] = times[wanted]
        return stamps if bool((stamps > 0).all()) else None


class ChunkLog:
    """One writer's chunk times: slot ``k`` holds when chunk ``k`` was handed out (0: not noted)."""

    def __init__(self, path: Path, max_chunks: int) -> None:
        with open(path, "wb+") as file:
            file.truncate(max_chunks * 8)
            self._map = mmap.mmap(file.fileno(), max_chunks * 8)
        self._times: npt.NDArray[Any] = np.frombuffer(self._map, dtype=np.int64)

    def note(self, chunk: int) -> None:
        if chunk < self._times.size:
            self._times[chunk] = time.monotonic_ns()
