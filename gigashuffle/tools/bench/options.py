"""The options of ``gigashuffle bench`` and what its columns mean: standard library only, so ``--help`` answers at
once (the measuring modules import torch, which takes seconds) and a missing extra is told in one line."""

from __future__ import annotations

import argparse
import importlib.util

WORKLOAD_NAMES = ("image", "tokens", "tiny")  # the keys of workloads.WORKLOADS (a unit test keeps them equal)
# Workers of the DataLoader baseline: one per core of the 2-core machine the figures come from. The loader runs as
# many writers by default, so both mix rows from as many sources (NOTE [ One ideal ] in runner.py).
DATALOADER_WORKERS = 2
EXTRA_MODULES = ("psutil",)  # the bench extra's modules that the bench imports (asv is for benchmarks/ only)
INSTALL_EXTRA = "pip install 'gigashuffle[bench]'"

LEGEND = """\
what the columns mean:
  samples/s, MB/s    rows and bytes delivered per second over the timed window (after warm-up)
  copy floor         one process gathering random rows into a batch: no IPC, a ceiling for any loader
  warm-up            batches read (and seconds) from the first batch until the buffer was min_mixing full; the
                     timed window starts after it
  busy %             share of the window the node lock was held; near 100%: more processes add nothing
  shuffle quality, measured over the same first rows of each implementation, against ONE ideal: a uniform buffer
  of shuffle_size slots read as many times (its own row); every figure is in rows of the combined write stream
  displacement       mean |read position - write position|; ratio = displacement / the ideal's (1.0: as mixed
                     as the ideal; lower: nearer FIFO order). It cannot see where rows came from: two DataLoader
                     workers of shuffle_size/2 rows each score about the ideal though a batch draws on one of them
  buffer fill        mean share of the loader's slots that were full (a writer-bound run stays near min_mixing)
  slot age           mean rows written between a row's write and its read (the newest row seen stands for "rows
                     written so far", for the ideal too; the ideal's true mean is shuffle_size)
  read lag           mean (read position - write position); about 0 in a steady state, negative while a buffer
                     fills or favours fresh rows, positive when it favours old ones
  writers/batch      mean distinct writers (loader) or workers (DataLoader) in a batch; first 1k: over the first
                     1,000 batches. A DataLoader batch comes from one worker's buffer: always 1.00, whatever its
                     workers; the loader's node-wide buffer mixes every writer's rows into each batch
  dup %              rows delivered more than once (must be 0)
  (est.)             write order estimated from each writer's share (rows had no write time)"""


def missing_extra() -> str | None:
    """One line naming the extra to install, or None when every module the bench needs is importable."""
    missing = [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return f"gigashuffle bench needs {', '.join(missing)}: {INSTALL_EXTRA}"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _not_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gigashuffle bench",
        description="Benchmark the loader against a copy floor and a torch DataLoader. Progress goes to stderr, "
        f"the tables to stdout. Needs the bench extra: {INSTALL_EXTRA}",
        epilog=LEGEND,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workload",
        action="append",
        choices=[*WORKLOAD_NAMES, "all"],
        help="workload to run (repeatable; default: all)",
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="timed seconds per implementation (default 5)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--no-baselines", action="store_true", help="measure the loader only")
    parser.add_argument("--no-loader", action="store_true", help="measure the baselines only")
    parser.add_argument(
        "--writers",
        type=_positive,
        default=DATALOADER_WORKERS,
        help=f"writer processes per rank (default {DATALOADER_WORKERS}, the DataLoader baseline's workers)",
    )
    parser.add_argument("--readers", type=_positive, default=1, help="reader processes per rank (default 1)")
    parser.add_argument(
        "--step-ms",
        type=_not_negative,
        default=0.0,
        help="a training step of this many ms after each timed batch of every rank, as a sleep (default 0: the "
        "trainer only takes batches, so the readers bound the run); with a step, the trainer bounds it, as a GPU "
        "step does, and the CPU figures show what the loader costs beside a busy trainer",
    )
    parser.add_argument(
        "--lock-stripes", type=_positive, default=1, help="DataloaderConfig.lock_stripes of every rank (default 1)"
    )
    parser.add_argument(
        "--ranks",
        type=_positive,
        default=1,
        help="trainer ranks of one node sharing one buffer, each its own process (default 1)",
    )
    parser.add_argument(
        "--shaped-floor",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the copy floor with the loader's processes (default: with the baselines)",
    )
    parser.add_argument(
        "--checkpoint-rows",
        choices=["none", "saved", "positions"],
        default="none",
        help="none: a dataset without state (default); saved/positions: a stateful one with that checkpoint_rows "
        "(one rank only; see gigashuffle/tools/bench/stateful.py)",
    )
    parser.add_argument("--redis-url", default=None, help="Redis to use (default: embedded private server)")
    parser.add_argument("--log-level", default="INFO", help="logging level for progress on stderr")
    return parser
