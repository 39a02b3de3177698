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

logging.disable(logging.WARNING)  # the loaders' progress lines
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))

from bench_loader import SMALL, _config  # noqa: E402  (the tree's workload)

import gigashuffle  # noqa: E402  (the tree's, by PYTHONPATH)
from gigashuffle import MultiprocessShuffledDataloader  # noqa: E402
from gigashuffle.tools.bench.workloads import RepeatingChunkDataset  # noqa: E402


def _machine_busy_s() -> float:
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / 100  # all but idle and iowait, in USER_HZ (100 on Linux)


def one_loader() -> tuple[float, float, float]:
    """Seconds to the first batch, seconds of close(), machine CPU seconds over the loader's life."""
    busy, start = _machine_busy_s(), time.monotonic()
    with MultiprocessShuffledDataloader(RepeatingChunkDataset(SMALL), _config()) as loader:
        next(iter(loader))
        first = time.monotonic() - start
    return first, time.monotonic() - start - first, _machine_busy_s() - busy


def main() -> None:
    if not gigashuffle.__file__ or not gigashuffle.__file__.startswith(os.path.abspath(sys.argv[1])):
        raise SystemExit(
            f"gigashuffle comes from {gigashuffle.__file__}, not {sys.argv[1]}: set PYTHONPATH to the tree"
        )
    first = one_loader()
    later = [one_loader() for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 5)]
    print(f"first loader {first[0]:.2f} s; later: first batch median {statistics.median(r[0] for r in later):.3f} s, "
          f"close median {statistics.median(r[1] for r in later) * 1000:.0f} ms, machine CPU median "
          f"{statistics.median(r[2] for r in later):.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
