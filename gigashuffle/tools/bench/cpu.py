"""CPU seconds by process group over a timed window, per delivered row.

On a 2-core machine rows/s says little about a 64-core node: the loader may be fast here because it burns every
core. CPU microseconds per delivered row, split by who spends them (writers, readers, the trainer, the Redis
server, the zygote), is what tells how many rows a node can deliver per core and whether one shared process (the
Redis server, a single thread for the whole node) caps the node.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CpuReading = Callable[[], float]


def own_cpu_s() -> float:
    """User + system CPU seconds of this process (all its threads)."""
    times = os.times()
    return times.user + times.system


def process_cpu_s(pid: int) -> CpuReading:
    """A reading of another process's user + system CPU seconds (0 once it is gone)."""
    import psutil  # in the bench extra

    proc = psutil.Process(pid)

    def read() -> float:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return float(times.user + times.system)

    return read


def redis_cpu_s(client: Any) -> CpuReading:
    """The server's own CPU seconds from ``INFO cpu`` (its main thread and I/O threads together)."""

    def read() -> float:
        info = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    return read


@dataclass
class CpuMeter:
    """CPU seconds spent by each group between :meth:`start` and :meth:`stop`."""

    readings: Mapping[str, list[CpuReading]]
    _before: dict[str, float] = field(default_factory=dict)
    spent_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    def _read(self) -> dict[str, float]:
        return {group: sum(read() for read in reads) for group, reads in self.readings.items()}

    def start(self) -> None:
        self._before = self._read()
        self.wall_s = time.perf_counter()

    def stop(self) -> None:
        after = self._read()
        self.wall_s = time.perf_counter() - self.wall_s
        self.spent_s = {group: after[group] - self._before[group] for group in after}

    def per_row_us(self, rows: int, excluded_s: Mapping[str, float] | None = None) -> dict[str, float]:
        """Microseconds of CPU per delivered row, by group, plus ``all``; ``excluded_s``: CPU seconds of a group
        that were not the loader's (the bench's own bookkeeping in the trainer), taken off that group."""
        if rows <= 0:
            return {}
        excluded = excluded_s or {}
        out = {group: 1e6 * (spent - excluded.get(group, 0.0)) / rows for group, spent in self.spent_s.items()}
        out["all"] = sum(out.values())
        return out


def loader_meter(
    child_pids: Mapping[str, list[int]], redis_client: Any, other_ranks: Sequence[Mapping[str, list[int]]] = ()
) -> CpuMeter:
    """Meter a loader: its processes by role (``loader.child_pids()``), this process as the trainer, and Redis.

    ``other_ranks`` are the pids by role of the other trainer ranks sharing the node buffer, each with its own
    ``trainer`` pid: they are metered with this rank's processes of the same role. Redis is counted once, since
    the ranks of a node share one server.
    """
    readings: dict[str, list[CpuReading]] = {"trainer": [own_cpu_s]}
    for pids_by_role in (child_pids, *other_ranks):
        for role, pids in pids_by_role.items():
            readings.setdefault(role, []).extend(process_cpu_s(pid) for pid in pids)
    readings["redis"] = [redis_cpu_s(redis_client)]
    return CpuMeter(readings)


def own_meter() -> CpuMeter:
    """Meter this process alone (the copy floor runs in it)."""
    return CpuMeter({"trainer": [own_cpu_s]})
