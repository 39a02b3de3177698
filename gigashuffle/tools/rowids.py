"""Row ids that name their writer, as the bench and the demo write them: ``writer << WRITER_SHIFT | counter``.

The id says which writer wrote a row and in what order that writer wrote its own rows; the shuffle quality figures
(:mod:`gigashuffle.tools.quality`) read both out of it. numpy only: the demo, the bench's workloads, its stamps and
the quality figures all import this module, and it imports none of them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

ID_FIELD = "id"
# 2**40 rows per writer is far more than any benchmark writes, and 2**23 writers still fit in an int64.
WRITER_SHIFT = 40
COUNTER_MASK = (1 << WRITER_SHIFT) - 1

IntArray = npt.NDArray[np.int64]


def split_ids(ids: IntArray) -> tuple[IntArray, IntArray]:
    """(writer ids, per-writer row counters) of an array of row ids."""
    ids = np.asarray(ids, dtype=np.int64)
    return ids >> WRITER_SHIFT, ids & COUNTER_MASK
