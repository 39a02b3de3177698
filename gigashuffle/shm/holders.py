"""The holder registry: the processes that hold or held slots of a node's table, each named by pid and start time.

NOTE [ Holder registry ]
A slot's ``holder`` is a pid (4 bytes per slot, compared on every commit and release), and a pid can be reused as
soon as its process is reaped. So beside the header the table keeps a small registry: one row per process that
took slots, its pid and its start time (``/proc/<pid>/stat``, field 22), written under the node lock before the
first transition that gives it slots. A registered process is gone when no process with that pid and that start
time exists (a zombie still does: it may have been dying while it committed, and its pid is not reused before it
is reaped). That makes two things exact:
- Pid reuse: a new process that registers a pid already in the registry with another start time knows the old one
  is dead and first returns the slots held under that pid (they are not its own: it had none before registering),
  then takes the row over. A repair that finds the row's start time alive leaves the slots alone, so a repair
  after the supervisor saw a child reaped never takes the slots of a live process that reuses its pid.
- Repair driven by deaths: ``repair()`` reads each registered row and its process's start time *without* the
  lock (a /proc read per holder of the node, tens of microseconds in all) and takes the lock only when one is
  gone; then it passes once over the ``holder`` column for the gone pids (one vectorized compare, ~4 ms for 4M
  slots) and forgets their rows. With no death the periodic repair costs the node's lock nothing; the pass over
  every slot's state for holders the registry does not name runs only as a rare fallback (``scan=True``).
The table also records its creator's pid namespace (the inode of ``/proc/self/ns/pid``): a process in another
namespace sees other pids, so attaching from one is refused.
A row is written start time first, pid second (the pid marks the row used): a holder killed in between leaves an
unused row. Rows are never journaled: forgetting a gone row after its repair's commit is idempotent.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import numpy.typing as npt

from gigashuffle.host.pids import process_start

REGISTRY_ROWS = 1024  # processes holding slots of one node at once: far more than any node runs
REGISTRY_BYTES = REGISTRY_ROWS * 16
_PID, _START = 0, 1


class HolderRegistry:
    """The registry rows of one table (a ``(REGISTRY_ROWS, 2)`` int64 view: pid, start time)."""

    def __init__(self, rows: npt.NDArray[np.int64]) -> None:
        self.rows = rows
        self.known: set[int] = set()  # pids this mapping registered: the hot path checks only this set

    def gone(self) -> list[int]:
        """The registered pids whose process no longer exists. Without the lock the answer is a hint (check it
        again under the lock); under it, exact."""
        used = np.flatnonzero(self.rows[:, _PID] != 0)
        return [pid for pid, start in self.rows[used].tolist() if start == 0 or process_start(pid) != start]

    def lookup(self, pid: int) -> tuple[int, int]:
        """The row of ``pid`` and its start time; (-1, 0) if unregistered. Under the lock."""
        found = np.flatnonzero(self.rows[:, _PID] == pid)
        return (-1, 0) if not found.size else (int(found[0]), int(self.rows[found[0], _START]))

    def claim(self, pid: int, row: int) -> None:
        """Register ``pid`` in ``row`` (its own, or a free one) as the process now running. Under the lock."""
        start = process_start(pid)
        self.rows[row, _START] = start  # start first: a holder killed before the pid store leaves the row unused
        self.rows[row, _PID] = pid
        self.known.add(pid)

    def free_row(self) -> int:
        free = np.flatnonzero(self.rows[:, _PID] == 0)
        return int(free[0]) if free.size else -1

    def forget(self, pids: Collection[int]) -> None:
        """Drop the rows of gone pids whose slots were just repaired. Under the lock."""
        if pids:
            self.rows[np.isin(self.rows[:, _PID], list(pids)), _PID] = 0

    def alive(self) -> set[int]:
        """The registered pids that still run (for the fallback scan). Under the lock."""
        used = self.rows[self.rows[:, _PID] != 0]
        return {pid for pid, start in used.tolist() if start != 0 and process_start(pid) == start}
