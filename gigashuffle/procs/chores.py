"""What a child does between its real work: back off while it waits, and return dead holders' slots about once a
second (``Housekeeping``), off the hot path.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from gigashuffle.shm.slottable import SlotTable

log = logging.getLogger(__name__)

# How often a child returns slots of dead holders (the trainer does so at once for its own children).
_REPAIR_PERIOD_S = 1.0
# The fallback pass over every slot (NOTE [ Holder registry ] in shm/holders.py): rare, it holds the node lock.
_SCAN_PERIOD_S = 600.0


class Backoff:
    """Sleeps that start near 0.5 ms and double up to ``cap_s``: idle waits stay cheap, busy ones short."""

    def __init__(self, cap_s: float = 0.008, first_s: float = 0.0005) -> None:
        self.cap_s = cap_s
        self.first_s = first_s
        self.next_s = first_s

    def reset(self) -> None:
        self.next_s = self.first_s

    def sleep(self) -> None:
        time.sleep(self.next_s)
        self.next_s = min(self.next_s * 2, self.cap_s)


class _MapsTheTable(Protocol):
    """A child's env (``ChildEnv``), as far as its chores need it: the slot table once mapped. A protocol, since
    ``procs/childenv.py`` imports this module."""

    table: SlotTable | None


class Housekeeping:
    """What a child does about once a second, off the hot path: return the slots of dead holders (a /proc read per
    holder, the lock only after a death), and every ``scan_s`` the fallback pass over the whole table. No Redis:
    the trainers' heartbeats record the node's counts (NOTE [ Control plane ] in control/lua.py)."""

    def __init__(self, env: _MapsTheTable, period_s: float = _REPAIR_PERIOD_S, scan_s: float = _SCAN_PERIOD_S) -> None:
        self.env = env
        self.period_s, self.scan_s = period_s, scan_s
        self._due = time.monotonic() + period_s
        self._scan_due = time.monotonic() + scan_s

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + self.period_s
        scan = now >= self._scan_due
        if scan:
            self._scan_due = now + self.scan_s
        table = self.env.table
        if table is not None and (repaired := table.repair(scan=scan)):
            log.info("returned %d slots of dead processes", repaired)
