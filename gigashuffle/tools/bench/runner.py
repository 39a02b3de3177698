"""``gigashuffle bench``: the loader and its baselines side by side, one table.

For each workload: samples/s and MB/s of the loader, the copy floor and the DataLoader baseline; the
loader's start-up against ``python -c "import torch"``; the USS of each loader child; Redis commands per
batch; and shuffle quality of the loader and the DataLoader baseline against an ideal buffer.

The loader's own run is :mod:`.measureloader`, its probes :mod:`.loaderprobes`; the names imported from here
before they moved stay importable from here.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence

import torch

from gigashuffle.tools.bench import stateful
from gigashuffle.tools.bench.baselines import copy_floor, dataloader_baseline
from gigashuffle.tools.bench.cpu import own_meter
from gigashuffle.tools.bench.loaderprobes import ImportTorchTimer, child_memory, redis_command_calls
from gigashuffle.tools.bench.measureloader import _STREAM, FILL_EVERY_BATCHES, measure_loader
from gigashuffle.tools.bench.options import DATALOADER_WORKERS, build_parser
from gigashuffle.tools.bench.ranks import LOCK_STRIPES_VARIABLE, MIN_MIXING, STEP_MS_VARIABLE, step_ms
from gigashuffle.tools.bench.report import Result, format_table, ratio
from gigashuffle.tools.bench.shapedfloor import Shape, shaped_floor
from gigashuffle.tools.bench.stamps import ChunkStamps
from gigashuffle.tools.bench.streams import Stream, measure_quality, read_stream
from gigashuffle.tools.bench.workloads import WORKLOADS, Workload, get_workload

log = logging.getLogger(__name__)


def run_workload(
    name: str,
    seconds: float = 5.0,
    loader: bool = True,
    baselines: bool = True,
    redis_url: str | None = None,
    writers: int = 1,
    readers: int = 1,
    ranks: int = 1,
    shaped: bool | None = None,
) -> Result:
    """Measure one workload: ``seconds`` of timed batches for each implementation, one after the other.

    ``shaped``: also run the copy floor in the loader's shape (:mod:`.shapedfloor`), right after the loader;
    None runs it with the baselines."""
    workload = get_workload(name)
    result: Result = {
        "workload": name,
        "bs": workload.bs,
        "shuffle_size": workload.shuffle_size,
        "chunk_rows": workload.chunk_rows,
        "row_bytes": workload.row_bytes,
        "seconds": seconds,
        "torch_threads": torch.get_num_threads(),
        # Per rank, as in DataloaderConfig: the node runs writers * ranks writers and readers * ranks readers.
        "num_writers": writers,
        "num_readers": readers,
        "ranks": ranks,
        "min_mixing": MIN_MIXING,
        "step_ms": step_ms(),
    }
    stages = [name for name, on in (("copy floor and DataLoader", baselines), ("loader", loader)) if on]
    log.info("%s: measuring the %s, %g s each (progress on stderr, tables at the end)", name, " then ".join(stages),
             seconds)  # fmt: skip
    if baselines:
        result.update(_measure_baselines(workload, seconds))
    if loader:
        log.info("%s: starting the loader (%d writer(s), %d reader(s), %d rank(s))", name, writers, readers, ranks)
        result["loader"] = measure_loader(workload, seconds, redis_url, writers, readers, ranks)
        gc.collect()
    run_shaped = baselines if shaped is None else shaped
    if run_shaped:
        floor_run = shaped_floor(workload, seconds, Shape(writers, readers, ranks))
        result["shaped_floor"] = floor_run.to_dict()
        log.info("%s: copy floor in the loader's shape %.0f samples/s", name, floor_run.samples_per_s)
        if loader:
            result["loader_vs_shaped_floor"] = ratio(result["loader"]["samples_per_s"], floor_run.samples_per_s)
    _add_quality(workload, result)
    if loader and baselines:
        rate = result["loader"]["samples_per_s"]
        result["loader_vs_floor"] = ratio(rate, result["copy_floor"]["samples_per_s"])
        result["loader_vs_one_thread_floor"] = ratio(rate, result["copy_floor"]["one_thread_samples_per_s"])
        result["loader_vs_dataloader"] = ratio(rate, result["dataloader"]["samples_per_s"])
    return result


# NOTE [ One ideal ]
# The ideal of a quality figure is a simulated uniform buffer of shuffle_size slots read as many times as the
# implementation was, and it depends on that number (the first reads drain the initial fill). Each implementation
# was measured over its own rows once (5.7 million for the loader, 0.9 million for the DataLoader in a 3 s tiny
# run), so the table had two ideals under one header and ratios to different yardsticks. Both are now measured
# over the same first rows (the fewer of the two counts), against one ideal, shown as a row of its own.
def _add_quality(workload: Workload, result: Result) -> None:
    streams: dict[str, Stream] = {
        key: stream for key in ("loader", "dataloader") if key in result and (stream := result[key].pop(_STREAM))
    }
    if not streams:
        return
    rows = min(stream.rows for stream in streams.values())
    log.info("%s: shuffle quality over the first %d rows of %s", workload.name, rows, " and ".join(streams))
    started = time.perf_counter()
    for key, stream in streams.items():
        result[key]["quality"] = measure_quality(workload, stream, rows)
    log.info("%s: shuffle quality took %.1f s", workload.name, time.perf_counter() - started)


def _measure_baselines(workload: Workload, seconds: float) -> Result:
    meter = own_meter()
    meter.start()
    floor_rate = copy_floor(workload, seconds)
    meter.stop()
    floor = {**floor_rate.to_dict(), "cpu_us_per_row": meter.per_row_us(floor_rate.samples)}
    gc.collect()
    # A quarter of the window: one thread's steady rate needs no more (it only scales the loader_vs figures).
    floor["one_thread_samples_per_s"] = copy_floor(workload, max(seconds / 4, 0.5), threads=1).samples_per_s
    log.info(
        "%s: copy floor %.0f samples/s (%.0f on one thread)",
        workload.name, floor["samples_per_s"], floor["one_thread_samples_per_s"],
    )  # fmt: skip
    gc.collect()  # the floor's source tensor can be 600 MB: free it before the DataLoader forks
    with tempfile.TemporaryDirectory(prefix="gs-bench-stamps-") as stamps_dir:
        stamps = ChunkStamps(stamps_dir)
        run = dataloader_baseline(workload, seconds, DATALOADER_WORKERS, stamps=stamps)
        log.info("%s: DataLoader %.0f samples/s", workload.name, run.rate.samples_per_s)
        gc.collect()
        dataloader = {
            **run.rate.to_dict(),
            "num_workers": run.num_workers,
            "quality": None,
            _STREAM: read_stream(workload, run.ids, run.num_workers, stamps),
        }
    return {"copy_floor": floor, "dataloader": dataloader}


# ------------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stateful.mode = args.checkpoint_rows
    os.environ[LOCK_STRIPES_VARIABLE] = str(args.lock_stripes)
    os.environ[STEP_MS_VARIABLE] = str(args.step_ms)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    names = list(WORKLOADS) if not args.workload or "all" in args.workload else list(dict.fromkeys(args.workload))
    results = [
        run_workload(
            name,
            args.seconds,
            loader=not args.no_loader,
            baselines=not args.no_baselines,
            redis_url=args.redis_url,
            writers=args.writers,
            readers=args.readers,
            ranks=args.ranks,
            shaped=args.shaped_floor,
        )
        for name in names
    ]
    sys.stdout.write(json.dumps(results, indent=2) + "\n" if args.json else format_table(results))
    return 0


__all__ = [
    "FILL_EVERY_BATCHES",
    "ImportTorchTimer",
    "Result",
    "build_parser",
    "child_memory",
    "format_table",
    "main",
    "measure_loader",
    "redis_command_calls",
    "run_workload",
]


if __name__ == "__main__":
    raise SystemExit(main())
