"""Trainer ranks of one node for ``gigashuffle bench --ranks R``.

Rank 0 is the bench process; ranks 1..R-1 run this module (``python -m gigashuffle.tools.bench.ranks``), each with
its own loader on the same queue and Redis, so that all of them share one node buffer. Each rank is its own process
because trainers are separate processes in a real job: threads of one process would share one GIL and measure that
instead.

The bench and a rank process talk in JSON lines, the bench on the rank's stdin, the rank on its stdout:

* rank -> bench ``{"pids": {"trainer": [...], "writer": [...], ...}, "warmup": {...}}`` once its warm-up is done;
* bench -> rank ``{"end": T}``: time batches from now until ``time.monotonic() >= T``;
* rank -> bench ``{"rate": {...}}`` once its window is over;
* bench -> rank ``{"close": true}`` (or end of file): close the loader and exit.

The window's end is a ``time.monotonic()`` value rather than a duration: CLOCK_MONOTONIC is one clock for every
process of a machine, so every rank stops at the same instant whatever the pipe latency was when it was told to
start. Every wait on either side has a deadline, and a rank whose peer is gone closes its loader and exits.

The bench's side is :mod:`.otherranks`, the channel :mod:`.rankchannel`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from gigashuffle.tools.bench import stateful
from gigashuffle.tools.bench.baselines import timed_batches
from gigashuffle.tools.bench.rankchannel import LineChannel, PeerGone
from gigashuffle.tools.bench.workloads import RepeatingChunkDataset, Workload, get_workload

if TYPE_CHECKING:
    from gigashuffle import DataloaderConfig

log = logging.getLogger(__name__)

MIN_MIXING = 0.5
# --lock-stripes of `gigashuffle bench`, for every rank (the ranks it starts inherit it with the environment).
LOCK_STRIPES_VARIABLE = "GIGASHUFFLE_BENCH_LOCK_STRIPES"
# --step-ms of `gigashuffle bench`: the training step every rank's timed loop takes after each batch.
STEP_MS_VARIABLE = "GIGASHUFFLE_BENCH_STEP_MS"
# Give up waiting for the buffer to mix after this long and time what we get (flagged in the result).
WARMUP_CAP_S = 30.0
# A rank process imports torch, starts a loader and warms up; on a loaded 2-core machine that can take a while.
READY_TIMEOUT_S = 120.0 + WARMUP_CAP_S
# A rank waits this long for the bench to start its window: the bench waits for the slowest rank to be ready first.
GO_TIMEOUT_S = 2 * READY_TIMEOUT_S


def rank_config(
    workload: Workload,
    queue_name: str,
    writers: int,
    readers: int,
    rank: int,
    ranks: int,
    redis_url: str | None,
) -> DataloaderConfig:
    """The config of rank ``rank`` of a one-node job of ``ranks`` ranks: all of them share one buffer."""
    from gigashuffle import DataloaderConfig

    return DataloaderConfig(
        bs=workload.bs,
        shuffle_size=workload.shuffle_size,
        queue_name=queue_name,
        num_writers=writers,
        num_readers=readers,
        min_mixing=MIN_MIXING,
        local_rank=rank,
        global_rank=rank,
        local_world_size=ranks,
        global_world_size=ranks,
        redis_url=redis_url,
        checkpoint_rows=stateful.checkpoint_rows(),
        lock_stripes=int(os.environ.get(LOCK_STRIPES_VARIABLE, "1")),
    )


def mixing_threshold(workload: Workload) -> int:
    """Full slots an observer sees once the buffer has reached the mixing threshold.

    A reader takes a batch the moment full slots reach the threshold, so between batches an observer sees at most
    threshold - bs full slots: that is the sign the threshold was reached.
    """
    return math.ceil(MIN_MIXING * workload.shuffle_size) - workload.bs


@dataclass(frozen=True)
class WarmUp:
    batches: int
    seconds: float
    mixed: bool

    def to_dict(self) -> dict[str, Any]:
        return {"warmup_batches": self.batches, "warmup_s": self.seconds, "mixed": self.mixed}


def warm_up(
    next_batch: Callable[[], int],
    full_slots: Callable[[], int],
    threshold: int,
    cap_s: float,
    min_batches: int = 1,
) -> WarmUp:
    """Read batches until ``threshold`` full slots were seen once and ``min_batches`` were read (or ``cap_s`` passed).

    ``min_batches`` matters for a rank that joins a node whose buffer is already mixed: until it has read a batch
    its own reader may not even be running, and its first batch would land in the timed window.
    """
    start = time.perf_counter()
    batches = 0
    while batches < min_batches or full_slots() < threshold:
        if time.perf_counter() - start > cap_s:
            log.warning("buffer never reached %d full slots in %.0f s; timing it unmixed", threshold, cap_s)
            return WarmUp(batches, time.perf_counter() - start, False)
        next_batch()
        batches += 1
    return WarmUp(batches, time.perf_counter() - start, True)


# -------------------------------------------------------------------------------------------- rank side


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # SystemExit unwinds the with-block, so the loader and its children are closed even when the bench escalates.
    raise SystemExit(128 + signum)


def step_ms() -> float:
    """The training step ``--step-ms`` asks for, in ms (0: none)."""
    return float(os.environ.get(STEP_MS_VARIABLE, "0"))


def with_training_step(step: Callable[[], int]) -> Callable[[], int]:
    """``step`` and then the training step of ``--step-ms``: a sleep, as a trainer waiting for its GPU step is idle,
    so the loader's processes are what the CPU figures meter, and the run is bound by the trainer."""
    pause_s = step_ms() / 1000
    if pause_s <= 0:
        return step

    def stepped() -> int:
        rows = step()
        time.sleep(pause_s)
        return rows

    return stepped


def run_rank(args: argparse.Namespace, channel: LineChannel) -> None:
    from gigashuffle import MultiprocessShuffledDataloader

    workload = get_workload(args.workload)
    cfg = rank_config(workload, args.queue, args.writers, args.readers, args.rank, args.ranks, args.redis_url)
    with MultiprocessShuffledDataloader(RepeatingChunkDataset(workload), cfg) as loader:
        batches: Iterator[Any] = iter(loader)

        def step() -> int:
            batch = next(batches)
            return len(batch[0][next(iter(batch[0]))])

        warm = warm_up(step, lambda: int(loader.stats().full), mixing_threshold(workload), WARMUP_CAP_S)
        # Every child must be running (and have a pid to meter) before the window; a writer may lag the reader.
        loader.wait_started(READY_TIMEOUT_S)
        channel.send({"pids": {"trainer": [os.getpid()], **loader.child_pids()}, "warmup": warm.to_dict()})
        end = float(channel.receive(time.monotonic() + GO_TIMEOUT_S, "the start of the window")["end"])
        rate = timed_batches(with_training_step(step), end - time.monotonic(), workload.row_bytes)
        channel.send({"rate": rate.to_dict()})
        # Stay open until the bench has read this rank's memory figures and says so (or is gone).
        with contextlib.suppress(PeerGone):
            channel.receive(time.monotonic() + GO_TIMEOUT_S, "close")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gigashuffle.tools.bench.ranks",
        description="One trainer rank of gigashuffle bench --ranks (internal).",
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--writers", type=int, required=True)
    parser.add_argument("--readers", type=int, required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--log-level", default="WARNING")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s rank {args.rank} %(name)s %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # Reports go out on a private copy of stdout, and fd 1 becomes stderr: nothing else this process or its loader
    # children print can corrupt them, and the children (which inherit fd 1) do not keep the report pipe open
    # after this process is gone. os.dup gives a non-inheritable descriptor.
    report_fd = os.dup(1)
    os.dup2(2, 1)
    channel = LineChannel(0, report_fd, "the bench")
    try:
        run_rank(args, channel)
    except PeerGone as exc:
        log.error("stopping: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
