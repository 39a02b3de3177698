"""``ResumePoint``: where a writer starts, the one type it has wherever it travels.

A writer starts from a point when it is first spawned, when ``load_state_dict`` sends it one (``LoadState``) and
when it is respawned after a death (checkpoint/respawn.py, NOTE [ Respawned writers ] in procs/resume.py); the
spec it is spawned with (``ChildSpec.start``) and the message carry the same value. The point says:
  * ``state``: the dataset's state to load (None: the dataset as the loader was given it);
  * ``rows``: a checkpoint's saved rows to put back into the buffer first (NOTE [ Checkpoint cut ]);
  * which rows of the stream after ``state`` to write: ``state`` is stream row ``base`` of the writer's stream;
    the first ``skip`` rows after it were written already; of the rows before ``until`` only those in ``keep``
    (absolute stream rows, sorted) are written, and every row from ``until`` on (NOTE [ Positions checkpoint ];
    no filter: ``keep`` empty and ``until <= base``);
  * ``serial``: the number its commit counter is kept under, new at every load and respawn, so that a report or
    a counter of an earlier start is never taken for this one's.
numpy is imported when a point is made, not at import (see gigashuffle/rowblock.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gigashuffle.rowblock import NO_ROWS, RowBlock

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    StreamRows = npt.NDArray[np.int64]


def _no_rows() -> StreamRows:
    import numpy as np

    return np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class ResumePoint:
    state: Any = None
    skip: int = 0
    serial: int = 0
    base: int = 0
    keep: StreamRows = field(default_factory=_no_rows)
    until: int = 0
    rows: RowBlock = NO_ROWS

    @property
    def filtering(self) -> bool:
        """Whether the point re-reads with a filter (a checkpoint by positions, resumed or respawned)."""
        return len(self.keep) > 0 or self.until > self.base
