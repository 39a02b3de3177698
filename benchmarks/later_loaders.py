"""A process's later loaders, for side-by-side runs of trees (docs/benchmarks.md, "A closed loader's zygote serves the
next loader"): ``PYTHONPATH=<tree> python benchmarks/later_loaders.py <tree> [loaders]``, from a venv without
gigashuffle installed. One loader, then ``loaders`` more, one after the other: the first one's seconds to its first
batch, and the later ones' medians of that, of ``close()`` and of the whole machine's CPU seconds over each
loader's life. Uses only the public API and ``<tree>/benchmarks/bench_loader.py``'s workload, so it runs on older
trees too.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def _machine_busy_s() -> float:
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / 100  # all but idle and iowait, in USER_HZ (100 on Linux)


def one_loader(make: Callable[[], Any]) -> tuple[float, float, float]:
    """Seconds from ``make()`` to the loader's first batch, seconds of its close(), machine CPU seconds over its
    life."""
    busy, start = _machine_busy_s(), time.monotonic()
    with make() as loader:
        next(iter(loader))
        first = time.monotonic() - start
    return first, time.monotonic() - start - first, _machine_busy_s() - busy


def main() -> None:
    tree = os.path.abspath(sys.argv[1])
    sys.path.insert(0, os.path.join(tree, "benchmarks"))
    logging.disable(logging.WARNING)  # the loaders' progress lines
    from bench_loader import SMALL, _config  # the tree's workload

    import gigashuffle
    from gigashuffle import MultiprocessShuffledDataloader
    from gigashuffle.tools.bench.workloads import RepeatingChunkDataset

    if not (gigashuffle.__file__ or "").startswith(tree):
        raise SystemExit(f"gigashuffle comes from {gigashuffle.__file__}, not {tree}: set PYTHONPATH to the tree")

    def make() -> Any:
        return MultiprocessShuffledDataloader(RepeatingChunkDataset(SMALL), _config())

    first = one_loader(make)
    later = [one_loader(make) for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 5)]
    print(f"first loader {first[0]:.2f} s; later: first batch median {statistics.median(r[0] for r in later):.3f} s, "
          f"close median {statistics.median(r[1] for r in later) * 1000:.0f} ms, machine CPU median "
          f"{statistics.median(r[2] for r in later):.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
