"""What a reader adds to its metrics counters per draw, never per row (NOTE [ Child counters ] in shm/counters.py)."""

from __future__ import annotations

import numpy as np

from gigashuffle.shm.counters import R_AGE_N, R_AGE_SUM, R_WRITERS_N, R_WRITERS_SUM, ChildCounters, Every
from gigashuffle.shm.slottable import SlotIds, SlotTable, Versions

_AGES_SAMPLED = Every()  # draws whose rows' ages are added (SAMPLE_EVERY in shm/counters.py)
_WRITERS_SAMPLED = Every()  # draws whose first batch's writers are counted


def _account_draw(counters: ChildCounters, table: SlotTable, versions: Versions | None) -> None:
    """Per draw attempt (never per row): the buffer's fill and, for drawn rows on a sampled draw
    (``SAMPLE_EVERY`` in shm/counters.py), their age in rows written since."""
    full, clock = table.full_and_clock()
    counters.sample_fill(full)
    if versions is not None and len(versions) and _AGES_SAMPLED():
        words = counters.words
        words[R_AGE_SUM] += clock * len(versions) - int(versions.sum())
        words[R_AGE_N] += len(versions)


def _count_writers(table: SlotTable, batch: SlotIds, words: memoryview[float]) -> None:
    """The distinct writers of one batch of a sampled draw (its first: the draw is uniform, so it is a fair
    sample) for ``loader.metrics()``; read before the release, while no writer can take these slots (about 2 us
    for 64 rows, 5 for 1,024)."""
    if len(batch):
        writers = table.writer.take(batch)
        writers.sort()
        words[R_WRITERS_SUM] += 1 + int(np.count_nonzero(writers[1:] != writers[:-1]))
        words[R_WRITERS_N] += 1
