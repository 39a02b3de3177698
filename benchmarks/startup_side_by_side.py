"""Start-up of a process's later loaders, with the zygote the last one parked and with a fresh one, side by side
(docs/benchmarks.md, "A closed loader's zygote serves the next loader"): ``python benchmarks/startup_side_by_side.py
[rounds]``. Each round measures one loader of each kind, in alternating order: seconds from the constructor to the
first batch, and the CPU seconds of the whole machine over the loader's life (so the zygote, the children and the
embedded Redis count). A script, not an asv benchmark (asv's is ``bench_loader.StartUp``): it imports its siblings
only when run, so that asv's discovery, which imports every module here, passes over it.
"""

from __future__ import annotations

import os
import statistics
import sys


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_loader import SMALL, _config
    from later_loaders import one_loader

    from gigashuffle import MultiprocessShuffledDataloader
    from gigashuffle.procs.zygotereuse import PARKING
    from gigashuffle.tools.bench.workloads import RepeatingChunkDataset

    def make() -> MultiprocessShuffledDataloader:
        return MultiprocessShuffledDataloader(RepeatingChunkDataset(SMALL), _config())

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    one_loader(make)  # the embedded server, the page cache and the first zygote: not measured
    runs: dict[str, list[tuple[float, float]]] = {"fresh zygote": [], "reused zygote": []}
    for r in range(rounds):
        for kind in sorted(runs, reverse=r % 2 == 1):
            if kind == "fresh zygote":
                PARKING.end_parked()
            first, _close, cpu = one_loader(make)
            runs[kind].append((first, cpu))
    for kind, measured in runs.items():
        firsts = [round(f, 2) for f, _ in measured]
        print(f"{kind}: first batch median {statistics.median(firsts):.2f} s {firsts}, machine CPU median "
              f"{statistics.median(c for _, c in measured):.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
