"""Lock time per ``SlotTable.repair()`` at N slots, for side-by-side runs of two trees (docs/benchmarks.md, "Repair
driven by the holder registry"): ``PYTHONPATH=<tree> python benchmarks/repair_side_by_side.py N``. A script, not an
asv benchmark (asv's is ``bench_slottable.Repair``); it uses only what both trees have.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import gigashuffle
from gigashuffle.shm.slottable import SlotTable


def build(slots: int) -> SlotTable:
    """60% full, a live writer's reservation and a live reader's batch, every page faulted in (a node that ran)."""
    table = SlotTable(slots, seed=0)
    me = os.getpid()
    table.commit_written(me, table.acquire_empty(me, int(0.6 * slots)))
    table.acquire_empty(me, 2048)
    table.draw_full(me, 4096)
    int(table.holder.sum()) + int(table.state.sum())
    return table


def lock_s(table: SlotTable, call: Callable[[], object]) -> tuple[float, float]:
    """The node lock's hold time and the wall time of one call."""
    before, start = table.lock_usage().held_s, time.perf_counter()
    call()
    return table.lock_usage().held_s - before, time.perf_counter() - start


def main() -> None:
    slots = int(sys.argv[1])
    table = build(slots)
    table.repair()
    runs = sorted(lock_s(table, table.repair) for _ in range(5))
    lock, wall = runs[2]
    pid = os.fork()  # a process that held 64 slots and was reaped
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    table.acquire_empty(pid, 64)
    death_lock, death_wall = lock_s(table, table.repair)
    print(
        f"{os.path.dirname(gigashuffle.__file__)} slots={slots}: repair without a death: lock {lock * 1e3:.3f} ms, "
        f"wall {wall * 1e3:.3f} ms; after a death (64 slots): lock {death_lock * 1e3:.3f} ms, "
        f"wall {death_wall * 1e3:.3f} ms"
    )


if __name__ == "__main__":
    main()
