"""``gigashuffle bench``: the loader and its baselines side by side, one table.

For each workload: samples/s and MB/s of the loader, the copy floor and the DataLoader baseline; the
loader's start-up against ``python -c "import torch"``; the USS of each loader child; Redis commands per
batch; and shuffle quality of the loader and the DataLoader baseline against an ideal buffer.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gigashuffle.tools.bench import stateful
from gigashuffle.tools.bench.baselines import copy_floor, dataloader_baseline, timed_batches
from gigashuffle.tools.bench.cpu import loader_meter, own_meter
from gigashuffle.tools.bench.options import DATALOADER_WORKERS, build_parser
from gigashuffle.tools.bench.ranks import (
    LOCK_STRIPES_VARIABLE,
    MIN_MIXING,
    READY_TIMEOUT_S,
    WARMUP_CAP_S,
    OtherRanks,
    mixing_threshold,
    rank_config,
    warm_up,
)
from gigashuffle.tools.bench.report import Result, format_table, ratio
from gigashuffle.tools.bench.shapedfloor import Shape, shaped_floor
from gigashuffle.tools.bench.stamps import ChunkStamps
from gigashuffle.tools.bench.streams import Stream, measure_quality, read_stream
from gigashuffle.tools.bench.workloads import ID_FIELD, WORKLOADS, RepeatingChunkDataset, Workload, get_workload

if TYPE_CHECKING:
    from gigashuffle.shm.slottable import LockUsage

log = logging.getLogger(__name__)

# During the timed window the trainer notes the buffer's full slots every this many batches (stats() takes the node
# lock for a count of its states: tens of microseconds): the displacement ratio depends on how full the buffer ran.
FILL_EVERY_BATCHES = 32
_STREAM = "_stream"  # a result's key for its rows until run_workload measures quality (never in the output)


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


# NOTE [ Bench bookkeeping ]
# The shuffle quality figures need the id of every row delivered from the first batch on, so the trainer copies
# each batch's ids out of the ring, in the timed window too. That copy is the bench's, not the loader's: the copy
# floor does nothing of the kind, and it cost the trainer 0.004-0.01 CPU-us per tiny row, a quarter to two fifths
# of what the trainer spends (the ids cross from the reader's core, and the growing list faults in fresh pages).
# The window therefore measures it with ``time.thread_time()`` around the copy and takes it off the trainer's CPU;
# it is reported on its own as ``bench_recording_us_per_row``. What the two clock reads cost stays in the trainer.
def _record_ids(batch: list[dict[str, torch.Tensor]], ids: list[np.ndarray]) -> None:
    for group in batch:
        if ID_FIELD in group:
            ids.append(group[ID_FIELD].numpy().copy())
            return


def measure_loader(
    workload: Workload,
    seconds: float,
    redis_url: str | None = None,
    writers: int = 1,
    readers: int = 1,
    ranks: int = 1,
) -> Result:
    """Start the loader on ``workload``, wait until it is mixed, then time ``seconds`` of batches.

    With ``ranks`` > 1 this process is rank 0 of a node of ``ranks`` trainer ranks sharing one buffer, and ranks
    1..ranks-1 run in processes of their own (:mod:`.ranks`); all ranks time the same window. Rates are the sum
    over the ranks, CPU is summed over every process of every rank (Redis once), quality is rank 0's stream.
    """
    # Imported here so the baselines and quality code work without the loader (and its imports).
    from gigashuffle import MultiprocessShuffledDataloader

    queue_name = f"bench-{workload.name}-{os.getpid()}-{secrets.token_hex(4)}"
    cfg = rank_config(workload, queue_name, writers, readers, 0, ranks, redis_url)
    import_torch = ImportTorchTimer()
    ids: list[np.ndarray] = []
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        # Write times, for the quality figures of rank 0's stream (the other ranks' writers reuse its writer ids).
        stamps = ChunkStamps(stack.enter_context(tempfile.TemporaryDirectory(prefix="gs-bench-stamps-")))
        dataset = stateful.wrap(RepeatingChunkDataset(workload, stamps=stamps if ranks == 1 else None))
        loader = stack.enter_context(MultiprocessShuffledDataloader(dataset, cfg))
        loader.get_dummy_batch()
        startup_s = time.perf_counter() - start
        import_torch_s = import_torch.seconds()
        log.info("%s: loader start-up %.2f s (import torch %.2f s)", workload.name, startup_s, import_torch_s)
        # Started only now: loader.redis_url is the Redis this rank resolved (with none given, the embedded server it
        # started), and every rank of the node must use that one to share the buffer. Left before the loader, so the
        # other ranks are gone before this one's loader (and the embedded server it holds) closes.
        others = stack.enter_context(OtherRanks(workload, queue_name, writers, readers, ranks, loader.redis_url))
        batches: Iterator[list[dict[str, torch.Tensor]]] = iter(loader)
        fills: list[int] = []
        timed = [False, 0]  # in the window yet; batches taken in it
        recording_s = [0.0]  # this thread's CPU spent recording row ids in the window: NOTE [ Bench bookkeeping ]

        def step() -> int:
            batch = next(batches)
            if timed[0]:
                started = time.thread_time()
                _record_ids(batch, ids)
                recording_s[0] += time.thread_time() - started
                timed[1] += 1
                if timed[1] % FILL_EVERY_BATCHES == 0:
                    fills.append(loader.stats().full)
            else:
                _record_ids(batch, ids)
            return len(batch[0][next(iter(batch[0]))])

        warm = warm_up(step, lambda: int(loader.stats().full), mixing_threshold(workload), WARMUP_CAP_S)
        loader.wait_started(READY_TIMEOUT_S)  # every child has a pid to meter before the window
        other_reports = others.wait_ready()
        client = loader.redis_client()
        meter = loader_meter(loader.child_pids(), client, [report.pids for report in other_reports])
        calls_before = redis_command_calls(client)
        lock_before = loader.lock_usage()
        meter.start()
        timed[0] = True
        end = time.monotonic() + seconds
        others.start_window(end)
        rate = timed_batches(step, end - time.monotonic(), workload.row_bytes)
        meter.stop()
        lock_after = loader.lock_usage()
        # The INFOs of the meter and of calls_before show up in the second snapshot: take them off.
        redis_calls = redis_command_calls(client) - calls_before - 3
        other_reports = others.collect_rates(end)
        # The other ranks are still open (they wait for the close that leaving ``others`` sends): measure them now.
        children = [{"rank": 0, **child} for child in child_memory(loader.child_pids())]
        for report in other_reports:
            children_pids = {role: pids for role, pids in report.pids.items() if role != "trainer"}
            children += [{"rank": report.rank, **child} for child in child_memory(children_pids)]
        stream = read_stream(workload, ids, writers, stamps) if ids and ranks == 1 else None
    if ranks > 1:
        # Quality estimates write positions as if every writer had started at once and wrote at the same rate; the
        # writers of later ranks start seconds later, so the figures would be artefacts of the estimate.
        log.info("%s: no shuffle quality with %d ranks (the writers of the ranks start at different times)",
                 workload.name, ranks)  # fmt: skip
    per_rank = [{"rank": 0, **rate.to_dict(), **warm.to_dict()}]
    per_rank += [{"rank": report.rank, **(report.rate or {}), **report.warmup} for report in other_reports]
    samples = sum(int(r["samples"]) for r in per_rank)
    batches_total = sum(int(r["batches"]) for r in per_rank)
    samples_per_s = sum(float(r["samples_per_s"]) for r in per_rank)
    lock = _lock_figures(lock_before, lock_after, meter.wall_s, batches_total, samples)
    return {
        # Totals over the ranks; "seconds" is rank 0's window, which the others share.
        "samples": samples,
        "batches": batches_total,
        "seconds": rate.seconds,
        "row_bytes": workload.row_bytes,
        "samples_per_s": samples_per_s,
        "mb_per_s": samples_per_s * workload.row_bytes / 1e6,
        "ranks": ranks,
        "per_rank": per_rank,
        "startup_s": startup_s,
        "import_torch_s": import_torch_s,
        "startup_vs_import_torch": startup_s / import_torch_s,
        "warmup_batches": warm.batches,
        "warmup_s": warm.seconds,
        "mixed": all(bool(r["mixed"]) for r in per_rank),
        "redis_calls": redis_calls,
        "redis_cmds_per_batch": redis_calls / batches_total,
        "cpu_us_per_row": meter.per_row_us(samples, {"trainer": recording_s[0]}),
        "bench_recording_us_per_row": 1e6 * recording_s[0] / samples,
        **lock,
        # The mean fraction of the buffer's slots that were full, sampled in the window (None: too few batches).
        "mean_fill": sum(fills) / len(fills) / workload.shuffle_size if fills else None,
        "children": children,
        "quality": None,  # set by run_workload, over as many rows as the DataLoader's (NOTE [ One ideal ])
        _STREAM: stream,
    }


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


# ---------------------------------------------------------------------------------------------- table


# ------------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stateful.mode = args.checkpoint_rows
    os.environ[LOCK_STRIPES_VARIABLE] = str(args.lock_stripes)
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


if __name__ == "__main__":
    raise SystemExit(main())
