"""The loader's part of ``gigashuffle bench``: start it (and the node's other ranks), warm it up, time a window
of batches and gather its figures into one result; :mod:`.runner` sets it beside the baselines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import torch

from gigashuffle.tools.bench import stateful
from gigashuffle.tools.bench.baselines import timed_batches
from gigashuffle.tools.bench.cpu import loader_meter
from gigashuffle.tools.bench.loaderprobes import ImportTorchTimer, _lock_figures, child_memory, redis_command_calls
from gigashuffle.tools.bench.otherranks import OtherRanks
from gigashuffle.tools.bench.ranks import (
    READY_TIMEOUT_S,
    WARMUP_CAP_S,
    mixing_threshold,
    rank_config,
    warm_up,
    with_training_step,
)
from gigashuffle.tools.bench.report import Result
from gigashuffle.tools.bench.stamps import ChunkStamps
from gigashuffle.tools.bench.streams import read_stream
from gigashuffle.tools.bench.workloads import ID_FIELD, RepeatingChunkDataset, Workload

log = logging.getLogger(__name__)

# During the timed window the trainer notes the buffer's full slots every this many batches (stats() takes the node
# lock for a count of its states: tens of microseconds): the displacement ratio depends on how full the buffer ran.
FILL_EVERY_BATCHES = 32
_STREAM = "_stream"  # a result's key for its rows until run_workload measures quality (never in the output)


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
        rate = timed_batches(with_training_step(step), end - time.monotonic(), workload.row_bytes)
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
