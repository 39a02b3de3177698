"""A soak of one loader: minutes of reading under random faults, then a resume; every row once, nothing that grows.

One trainer process reads a stateful dataset of numbered rows (``PassIds``: per writer and pass, ``ids`` rows) from
a loader with 2 writers and 2 readers. After ``--warmup-s`` of reading, for ``--seconds`` and at least ``--events``
faults, a seeded schedule does one of these at random moments between batches:
  * ``kill_writer`` / ``kill_reader``: SIGKILL one of the loader's children (it is started again);
  * ``checkpoint``: ``state_dict()``, kept as the latest checkpoint with the rows read before it;
  * ``ctrl_c_checkpoint``: ``state_dict()`` with a SIGINT sent to this process while it runs (a random 0-20 ms
    after the call; the script's own SIGINT handler raises ``KeyboardInterrupt`` only inside that call), then,
    once it raised or returned, ``state_dict()`` again: the seam where an aborted cut used to poison the next;
  * ``kill_in_checkpoint``: ``state_dict()`` with a SIGKILL sent to a random writer or reader 0-20 ms after the
    call (the cut waits for its successor).
At the end it takes a last checkpoint, closes the loader, resumes that checkpoint in a new one and reads until every
row of every pass it had begun came, and ``--drain-past`` rows more.

What it checks (exit status 1 and a line on stderr if any fails; the report is JSON on stdout):
  * exactness: over the rows read before the last checkpoint and after its resume, each (pass, id) of the passes
    each writer had begun before it came exactly once, and no row came twice while the first loader ran;
  * resources of the trainer process: open fds, threads, memory mappings, child processes (recursive) and RSS,
    sampled after the warm-up (and a first checkpoint) and again after ``--settle-s`` of reading without faults;
    the second may not exceed the first by more than ``RESOURCE_SLACK`` (RSS: ``RSS_SLACK_BYTES``), and after the
    loaders close no child process of this one is left;
  * no hang: a watchdog thread dumps every thread's stack and ends the run (exit status 3) when no batch or
    checkpoint came for ``--stall-s``.

Usage: ``python tests/soak/soak.py --seconds 600 --seed 7 --way positions [--redis-url URL]`` (no URL: the
embedded server). tests/soak/test_soak.py runs 16 faults of a fixed seed each way; docs/soak.md has long runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import json
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil

_TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_TESTS / "integration"), str(_TESTS)]
from datasets import ID_STRIDE, PassIds  # noqa: E402  (tests/integration's: the path above)
from leaks import open_fds  # noqa: E402  (tests/)
from sigint_gate import Gate  # noqa: E402  (tests/)

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader  # noqa: E402
from gigashuffle.procs.zygotereuse import parked_zygote_pid  # noqa: E402

EVENTS = ("kill_writer", "kill_reader", "checkpoint", "ctrl_c_checkpoint", "kill_in_checkpoint")
# Growth allowed, last sample over first. fds: the Redis client's pool opens a second connection the first time two
# threads (the trainer's and the heartbeat's) call Redis at once, and keeps it; a leak per fault would pass this
# within a few faults.
RESOURCE_SLACK = {"fds": 2, "threads": 0, "maps": 0, "children": 0}
RSS_SLACK_BYTES = 64 << 20
Row = tuple[int, int]  # (pass, id)


class RowCounts:
    """How often each (pass, id) came, in one byte each: a dict of a million rows would be the RSS growth measured."""

    def __init__(self, ids: int, writers: int = 2) -> None:
        self.ids, self.writers = ids, writers  # writers: of the job (their get_worker_info().id number the ids)
        self.counts = np.zeros(0, dtype=np.uint8)

    def index(self, passes: np.ndarray, row_ids: np.ndarray) -> np.ndarray:
        """Where rows (pass, id) are counted."""
        return (passes * self.writers + row_ids // ID_STRIDE) * self.ids + row_ids % ID_STRIDE

    def add(self, where: np.ndarray) -> int:
        """Count rows (``index``); returns how many of them had come before."""
        if len(where) and where.max() >= len(self.counts):
            size = max(2 * len(self.counts), int(where.max()) + 1)
            per_pass = self.writers * self.ids
            grown = np.zeros(-(-size // per_pass) * per_pass, dtype=np.uint8)  # whole passes
            grown[: len(self.counts)] = self.counts
            self.counts = grown
        again = int(np.count_nonzero(self.counts[where]))
        np.add.at(self.counts, where, 1)
        return again + len(where) - len(np.unique(where))

    def copy(self) -> RowCounts:
        other = RowCounts(self.ids, self.writers)
        other.counts = self.counts.copy()
        return other

    def total(self) -> int:
        return int(self.counts.sum())

    def begun(self) -> np.ndarray:
        """Whether each counted place is a row of a pass its writer had begun: any row of it, or of a later one,
        counted (the writers' passes run apart: a writer started again often is passes behind the other)."""
        by_pass = self.counts.reshape(-1, self.writers, self.ids)  # whole passes: the array grows by whole passes
        last = [np.flatnonzero(by_pass[:, w].any(axis=1)) for w in range(self.writers)]
        mask = np.zeros_like(by_pass, dtype=bool)
        for w, seen in enumerate(last):
            if len(seen):
                mask[: int(seen[-1]) + 1, w] = True
        return mask.reshape(-1)

    def row(self, index: int) -> Row:
        return index // (self.writers * self.ids), (index // self.ids) % self.writers * ID_STRIDE + index % self.ids


def _sample(me: psutil.Process) -> dict[str, int]:
    return {
        "fds": me.num_fds(),
        "threads": me.num_threads(),
        "maps": sum(_mapped_files().values()),
        "children": len(me.children(recursive=True)),
        "rss": me.memory_info().rss,
    }


def _mapped_files() -> collections.Counter[str]:
    """This process's mappings of files (memfds included) by path; the allocator's ([heap], anonymous) vary."""
    maps: collections.Counter[str] = collections.Counter()
    with open("/proc/self/maps") as lines:
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) > 5 and parts[5].startswith("/"):
                maps[parts[5].strip()] += 1
    return maps


def _config(args: argparse.Namespace, queue: str) -> DataloaderConfig:
    return DataloaderConfig(
        bs=args.bs, shuffle_size=args.shuffle_size, queue_name=queue, num_writers=2, num_readers=2,
        redis_url=args.redis_url or None, checkpoint_rows=args.way, max_restarts=1_000_000,
        lock_stripes=args.lock_stripes,
    )  # fmt: skip


def _details() -> dict[str, collections.Counter[str]]:
    """What this process's fds point at, the files it maps and its threads by name: for the report when a count
    grew."""
    threads = collections.Counter(thread.name.rstrip("0123456789") for thread in threading.enumerate())
    return {"fds": _fd_targets(), "maps": _mapped_files(), "threads": threads}


def _fd_targets() -> collections.Counter[str]:
    sockets = {
        c.fd: f"socket {c.family.name} {c.type.name} to {c.raddr or '-'}"
        for c in psutil.Process().net_connections("all")
    }
    return collections.Counter(sockets.get(fd) or target.split(":[")[0] for fd, target in open_fds())


class Watchdog:
    """Ends the run with every thread's stack when ``beat()`` was not called for ``stall_s``: one thread for the
    whole run (``faulthandler.dump_traceback_later`` starts a thread per call, which the thread count would see)."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="soak-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self.last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            if time.monotonic() - self.last > self.stall_s:
                print(f"soak: nothing came for {self.stall_s:.0f} s: a hang", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(3)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def signalled(handler: Gate, rng: random.Random, interrupt: bool, victim: int) -> Iterator[None]:
    """Around one loader call: with ``interrupt``, a SIGINT to this process, with ``victim``, a SIGKILL to that
    child, a random 0-20 ms after the call begins; ``handler`` raises KeyboardInterrupt only meanwhile."""
    timer = None
    if interrupt or victim:
        pid, sig = (os.getpid(), signal.SIGINT) if interrupt else (victim, signal.SIGKILL)
        timer = threading.Timer(rng.uniform(0.0, 0.02), _kill, (pid, sig))
        timer.start()
    handler.armed = True
    try:
        yield
    finally:
        handler.armed = False
        if timer is not None:
            timer.join()


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the victim died meanwhile (another fault, the loader's close)
        os.kill(pid, sig)


class Faulting:
    """What a soak's loader process (``Soak``, and each rank of nodesoak.py) does alike: pick a child to kill, and
    sample its own resources. Needs ``args``, ``rng``, ``read``, ``counted``, ``samples`` and ``details``."""

    args: argparse.Namespace
    rng: random.Random
    read: RowCounts
    counted: RowCounts
    samples: list[dict[str, int]]
    details: list[dict[str, collections.Counter[str]]]

    def _child(self, loader: MultiprocessShuffledDataloader, *roles: str) -> int:
        """A random live child of these roles (0: none)."""
        pids = [pid for role in roles for pid in loader.child_pids(timeout_s=self.args.stall_s)[role]]
        return self.rng.choice(pids) if pids else 0

    def _kill_one(self, loader: MultiprocessShuffledDataloader, role: str) -> None:
        """SIGKILL a random live child of ``role``. "Live" is the trainer's view: a child may have died since (the
        zygote reaped it and the trainer has not read that yet), so its pid may be gone."""
        victim = self._child(loader, role)
        if victim:
            _kill(victim, signal.SIGKILL)

    def _sample(self, me: psutil.Process) -> None:
        sample = _sample(me)
        # This script's own counts grow with the rows read (a byte per row, and the copy at the last checkpoint).
        sample["rss"] -= self.read.counts.nbytes + self.counted.counts.nbytes
        self.samples.append(sample)
        self.details.append(_details())


class Soak(Faulting):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.queue = f"soak-{uuid.uuid4().hex[:8]}"
        # Two streams: the schedule (which fault, and when) is the seed's alone; which child and the signals' delays
        # draw from the other, whose draws depend on how many children are alive.
        self.schedule = random.Random(args.seed)
        self.rng = random.Random(args.seed + 1)
        self.handler = Gate()
        self.read = RowCounts(args.ids)  # rows read by the first loader
        self.counted = RowCounts(args.ids)  # those read before the latest checkpoint
        self.checkpoint: dict[str, Any] | None = None
        self.events: collections.Counter[str] = collections.Counter()
        self.samples: list[dict[str, int]] = []
        self.details: list[dict[str, collections.Counter[str]]] = []
        self.batches = 0
        self.watchdog = Watchdog(args.stall_s)

    def _state_dict(self, loader: MultiprocessShuffledDataloader, interrupt: bool = False, victim: int = 0) -> bool:
        """A checkpoint, kept with the rows read so far; with ``interrupt``, a SIGINT is sent to this process
        meanwhile, with ``victim``, a SIGKILL to that child (a random 0-20 ms after the call). Returns whether the
        call raised KeyboardInterrupt."""
        try:
            with signalled(self.handler, self.rng, interrupt, victim):
                state = loader.state_dict()
        except KeyboardInterrupt:
            return True
        self.checkpoint, self.counted = state, self.read.copy()
        self.watchdog.beat()
        return False

    def _event(self, loader: MultiprocessShuffledDataloader) -> None:
        event = self.schedule.choice(EVENTS)
        self.events[event] += 1
        if event in ("kill_writer", "kill_reader"):
            self._kill_one(loader, event.removeprefix("kill_"))
        elif event == "checkpoint":
            self._state_dict(loader)
        elif event == "kill_in_checkpoint":
            self._state_dict(loader, victim=self._child(loader, "writer", "reader"))
        elif self._state_dict(loader, interrupt=True):
            self.events["ctrl_c_checkpoint_interrupted"] += 1
            self._state_dict(loader)

    def _read(self, batches: Any) -> None:
        group = next(batches)[0]
        again = self.read.add(self.read.index(group["pass"].numpy(), group["id"].numpy()))
        if again:
            raise SystemExit(f"soak: {again} rows came twice while the loader ran ({dict(self.events)})")
        self.batches += 1
        self.watchdog.beat()

    def run_first(self) -> None:
        """Read ``--warmup-s`` past the first batch without faults (then the first resource sample), then with them
        for ``--seconds`` and at least ``--events`` of them, then ``--settle-s`` without (then the last sample:
        respawns done, dead readers' rings let go), and take the last checkpoint."""
        args = self.args
        me = psutil.Process()
        with MultiprocessShuffledDataloader(PassIds(args.ids, args.chunk), _config(args, self.queue)) as loader:
            batches = iter(loader)
            self._read(batches)  # the fill: as long as a loaded machine makes it
            self._read_for(batches, args.warmup_s)
            # What the first checkpoint maps for good (the node's slot table) is mapped before the sample, and so
            # is what a wide op of the table opens for good (stats(): each stripe lock's own file description).
            self._state_dict(loader)
            loader.stats()
            self._sample(me)
            until = time.monotonic() + args.seconds
            while time.monotonic() < until or sum(self.events[e] for e in EVENTS) < args.events:
                self._read_for(batches, self.schedule.uniform(0.0, 2 * args.event_s))
                self._event(loader)
            self._read_for(batches, args.settle_s)
            self._sample(me)
            self._state_dict(loader)

    def _read_for(self, batches: Any, seconds: float) -> None:
        until = time.monotonic() + seconds
        while True:
            self._read(batches)
            if time.monotonic() >= until:
                return

    def run_resume(self) -> RowCounts:
        """Resume the last checkpoint and read until every row of the passes begun before it came, and more."""
        args = self.args
        if self.checkpoint is None:
            raise SystemExit("soak: no checkpoint was taken")
        missing = set(np.flatnonzero(self.counted.begun() & (self.counted.counts == 0)).tolist())
        after = RowCounts(args.ids)
        past = 0
        deadline = time.monotonic() + args.drain_s
        with MultiprocessShuffledDataloader(PassIds(args.ids, args.chunk), _config(args, self.queue)) as loader:
            loader.load_state_dict(self.checkpoint)
            batches = iter(loader)
            while past < args.drain_past and time.monotonic() < deadline:
                group = next(batches)[0]
                where = after.index(group["pass"].numpy(), group["id"].numpy())
                after.add(where)
                self.watchdog.beat()
                if missing:
                    missing.difference_update(where.tolist())
                else:
                    past += len(where)
            return after

    def report(self, after: RowCounts) -> tuple[dict[str, Any], list[str]]:
        args = self.args
        begun = self.counted.begun()
        lost, twice, failures = exactness(self.counted, after)
        growth, grown = resource_growth(self.samples, self.details, "the trainer")
        failures += grown
        first = self.samples[0]
        # Less the parked zygote: one per process, ended at its exit (NOTE [ Reused zygotes ] in procs/zygotereuse.py).
        left = [p for p in psutil.Process().children(recursive=True) if p.pid != parked_zygote_pid()]
        if left:
            failures.append(f"processes left after close: {[(p.pid, p.name()) for p in left]}")
        report = {
            "seed": args.seed, "way": args.way, "lock_stripes": args.lock_stripes, "kinds": list(EVENTS),
            "seconds": args.seconds, "batches": self.batches,
            "rows_before_last_checkpoint": self.counted.total(), "rows_after_resume": after.total(),
            "rows_checked": int(begun.sum()), "events": dict(self.events), "sigint_outside_calls": self.handler.stray,
            "lost": lost, "twice": twice, "first_sample": first, "growth": growth, "failures": failures,
        }  # fmt: skip
        return report, failures


def exactness(counted: RowCounts, after: RowCounts) -> tuple[int, int, list[str]]:
    """Rows of the passes begun before the last checkpoint (``counted``: read before it) never read, and rows read
    twice, over ``counted`` and ``after`` (read after its resume); with a line for each kind found."""
    begun = counted.begun()
    size = max(len(begun), len(after.counts))
    both = _padded(counted.counts, size).astype(np.int64) + _padded(after.counts, size)
    lost = np.flatnonzero(_padded(begun, size) & (both == 0))
    twice = np.flatnonzero(both > 1)
    failures = []
    if len(lost):
        failures.append(
            f"{len(lost)} rows of the passes begun never came, e.g. {[counted.row(int(i)) for i in lost[:5]]}"
        )
    if len(twice):
        failures.append(
            f"{len(twice)} rows came twice across the resume, e.g. {[counted.row(int(i)) for i in twice[:5]]}"
        )
    return len(lost), len(twice), failures


def resource_growth(
    samples: list[dict[str, int]], details: list[dict[str, collections.Counter[str]]], who: str
) -> tuple[dict[str, int], list[str]]:
    """Growth from the first sample to the last, and a line for each count grown past its slack (with what was
    added, from ``_details``)."""
    first, last = samples[0], samples[-1]
    growth = {key: last[key] - first[key] for key in first}
    failures = []
    for key, slack in RESOURCE_SLACK.items():
        if growth[key] > slack:
            failures.append(f"{who}'s {key} grew by {growth[key]} (from {first[key]})")
            if key in details[0]:
                new, gone = details[-1][key] - details[0][key], details[0][key] - details[-1][key]
                failures.append(f"{key} added: {dict(new)}; gone: {dict(gone)}")
    if growth["rss"] > RSS_SLACK_BYTES:
        failures.append(f"{who}'s RSS (less this script's row counts) grew by {growth['rss'] >> 20} MiB")
    return growth, failures


def _padded(counts: np.ndarray, n: int) -> np.ndarray:
    """``counts`` cut or padded with zeros to at least ``n`` entries."""
    return counts if len(counts) >= n else np.concatenate([counts, np.zeros(n - len(counts), dtype=counts.dtype)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long the first loader reads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--way", choices=("saved", "positions"), default="saved", help="DataloaderConfig.checkpoint_rows")
    p.add_argument("--redis-url", default="", help="a Redis to use (default: the embedded server)")
    p.add_argument("--event-s", type=float, default=0.5, help="mean time between two faults")
    p.add_argument("--events", type=int, default=0, help="at least this many faults, however long they take")
    p.add_argument("--ids", type=int, default=4000, help="rows per writer and pass")
    p.add_argument("--chunk", type=int, default=50)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--shuffle-size", type=int, default=512)
    p.add_argument("--lock-stripes", type=int, default=1, help="DataloaderConfig.lock_stripes (NOTE [ Stripes ])")
    p.add_argument("--warmup-s", type=float, default=3.0, help="reading before the faults and the first sample")
    p.add_argument("--settle-s", type=float, default=2.0, help="reading after the faults, before the last sample")
    p.add_argument("--stall-s", type=float, default=120.0, help="a call that takes longer is a hang")
    p.add_argument("--drain-past", type=int, default=512, help="rows read after the last wanted one")
    p.add_argument("--drain-s", type=float, default=300.0, help="the resume's deadline")
    p.add_argument(
        "--slow-reader-s", type=float, default=0.0,
        help="every reader sleeps this long between a draw's release and its announcement (a fail point): the "
        "window in which a cut's pause crosses a reader's batches",
    )  # fmt: skip
    args = p.parse_args(argv)
    faulthandler.enable()
    if args.slow_reader_s:  # read once, by the processes started from now on: procs/failpoints.py
        os.environ["GIGASHUFFLE_FAILPOINTS"] = f"reader.after_release=1:sleep={args.slow_reader_s}"
    soak = Soak(args)
    signal.signal(signal.SIGINT, soak.handler)
    soak.run_first()
    after = soak.run_resume()
    soak.watchdog.stop()
    report, _failures = soak.report(after)
    return finish("soak", report)


def finish(name: str, report: dict[str, Any]) -> int:
    """The report as one JSON line on stdout, each failure a line on stderr; the exit status."""
    print(json.dumps(report))
    for failure in report["failures"]:
        print(f"{name}: {failure}", file=sys.stderr)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
