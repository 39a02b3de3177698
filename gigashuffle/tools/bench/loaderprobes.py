"""What ``gigashuffle bench`` reads off a running loader besides its rate: the time of a bare ``import torch`` to
weigh its start-up against, Redis commands, each child's memory, and the slot table's locks over the window.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gigashuffle.shm.slottable import LockUsage

log = logging.getLogger(__name__)


class ImportTorchTimer:
    """Wall time of a fresh ``python -c "import torch"``: the start-up cost every torch job pays anyway.

    It runs while the loader starts, whose zygote imports torch at the same moment (a few seconds off the bench;
    on a loaded machine both slow down alike, so their ratio holds better than when timed apart). A thread waits
    for it, so the time is the subprocess's own even when the loader's start-up ends later."""

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._process = subprocess.Popen([sys.executable, "-c", "import torch"])
        self._ended: list[float] = []
        self._waiter = threading.Thread(target=self._wait, name="import-torch-timer", daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        self._process.wait()
        self._ended.append(time.perf_counter())

    def seconds(self) -> float:
        self._waiter.join()
        if self._process.returncode != 0:
            raise RuntimeError(f"python -c 'import torch' exited with code {self._process.returncode}")
        return self._ended[0] - self._started


def redis_command_calls(client: Any) -> int:
    """Total calls over all commands in ``INFO commandstats``."""
    stats = client.info("commandstats")
    return sum(int(entry.get("calls", 0)) for entry in stats.values() if isinstance(entry, dict))


def child_memory(child_pids: dict[str, list[int]]) -> list[dict[str, Any]]:
    """USS, PSS and shared (resident, file- or shm-backed) bytes of each loader child."""
    try:
        import psutil  # in the bench extra, not a core dependency
    except ImportError:
        log.warning("psutil is not installed (pip install 'gigashuffle[bench]'): no memory figures")
        return []
    rows = []
    for role, pids in sorted(child_pids.items()):
        for pid in pids:
            try:
                mem = psutil.Process(pid).memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied) as exc:
                log.warning("no memory figures for %s pid %d: %s", role, pid, exc)
                continue
            rows.append({"role": role, "pid": pid, "uss": mem.uss, "pss": mem.pss, "shared": mem.shared})
    return rows


def _lock_figures(
    before: LockUsage, after: LockUsage, wall_s: float, batches: int, rows: int
) -> dict[str, float | None]:
    """The slot table's locks over the window: the share of it that they were held (every rank's writers and
    readers together, summed over the stripes: NOTE [ Node lock budget ]), the mean hold, the holds per delivered
    batch, the lock time per delivered row, and the node's ceiling: the rows/s at which the busiest stripe's lock
    would be held all the time (NOTE [ Stripes ] in shm/stripes.py; with one stripe, 1 / lock time per row),
    whatever the node's cores."""
    held_s, holds = after.held_s - before.held_s, after.holds - before.holds
    stripes = [a - b for a, b in zip(after.stripes_held_s, before.stripes_held_s, strict=False)] or [held_s]
    busiest = max(stripes)
    return {
        "lock_busy": held_s / wall_s if wall_s > 0 else None,
        "lock_hold_us": 1e6 * held_s / holds if holds else None,
        "lock_holds_per_batch": holds / batches if batches else None,
        "lock_ns_per_row": 1e9 * held_s / rows if rows else None,
        "lock_stripes": len(stripes),
        "lock_busiest_stripe_busy": busiest / wall_s if wall_s > 0 else None,
        "lock_ceiling_rows_per_s": rows / busiest if busiest > 0 else None,
    }
