"""Start-up of a process's later loaders, with the zygote the last one parked and with a fresh one, side by side
(docs/benchmarks.md, "A closed loader's zygote serves the next loader"): ``python benchmarks/startup_side_by_side.py
[rounds]``. Each round measures one loader of each kind, in alternating order: seconds from the constructor to the
first batch, and the CPU seconds of the whole machine over that time (so the zygote, the children and the embedded
Redis count). A script, not an asv benchmark (asv's is ``bench_loader.StartUp``).
"""

from __future__ import annotations

import statistics
import sys
import time

from bench_loader import SMALL, _config

from gigashuffle import MultiprocessShuffledDataloader
from gigashuffle.procs.zygotereuse import PARKING
from gigashuffle.tools.bench.workloads import RepeatingChunkDataset


def _machine_busy_s() -> float:
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / 100  # all but idle and iowait, in USER_HZ (100 on Linux)


def one_loader() -> tuple[float, float]:
    """Seconds to the first batch, and the machine's CPU seconds over the loader's life."""
    busy, start = _machine_busy_s(), time.monotonic()
    with MultiprocessShuffledDataloader(RepeatingChunkDataset(SMALL), _config()) as loader:
        next(iter(loader))
        first = time.monotonic() - start
    return first, _machine_busy_s() - busy


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    one_loader()  # the embedded server, the page cache and the first zygote: not measured
    runs: dict[str, list[tuple[float, float]]] = {"fresh zygote": [], "reused zygote": []}
    for r in range(rounds):
        for kind in sorted(runs, reverse=r % 2 == 1):
            if kind == "fresh zygote":
                PARKING.end_parked()
            runs[kind].append(one_loader())
    for kind, measured in runs.items():
        firsts = [round(f, 2) for f, _ in measured]
        print(f"{kind}: first batch median {statistics.median(firsts):.2f} s {firsts}, machine CPU median "
              f"{statistics.median(c for _, c in measured):.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
