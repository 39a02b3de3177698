"""A soak of one node: several ranks (trainer processes) share one buffer under random faults, then a resume.

``--ranks`` processes (spawned, as torchrun starts them: local ranks 0..n-1 of one node, a job of n ranks) each read
the same loader's queue (2 writers and 2 readers per rank, ``PassIds`` rows numbered across the job's writers).
After the warm-up and a first checkpoint, a seeded schedule, the same on every rank, does ``--events`` of these
between batches (each rank reads a random number of batches, a mean of ``--event-batches``, before each):
  * ``kill_writer`` / ``kill_reader``: one rank (the schedule's pick) SIGKILLs one of its children;
  * ``checkpoint``: every rank calls ``state_dict()`` (the node's cut: NOTE [ Node cut ] in control/cutbarrier.py);
  * ``ctrl_c_checkpoint``: every rank calls ``state_dict()`` and sends itself SIGINT a random 0-20 ms after the call
    (torchrun's Ctrl-C reaches every rank; each rank's own handler raises ``KeyboardInterrupt`` only inside the call);
  * ``kill_in_checkpoint``: every rank calls ``state_dict()``; one of them SIGKILLs one of its children 0-20 ms after;
  * ``ctrl_c_one_rank``: every rank calls ``state_dict()``, and one of them sends itself SIGINT 0-20 ms after (a
    script's own Ctrl-C handling on one rank): the others' cut fails at once (NOTE [ Node cut ]: a rank that gave
    its cut up), and every rank calls again.
A checkpoint counts only when every rank's call returned: the ranks then merge their parts (``dict.update``) and
keep it with the rows each had read. When any rank's call raised (``KeyboardInterrupt``, or a ``CheckpointError``
because another rank's cut was cut short), every rank calls ``state_dict()`` again, as a training script that
retries a failed save on every rank would: the calls stay one per step on every rank.
At the end every rank takes a last checkpoint and closes; n new ranks load the merged checkpoint and read until
every row of the passes each writer had begun came to some rank, and ``--drain-past`` rows more.

It fails (exit status 1) on what soak.py fails on, across the node: a row that came twice to any rank while the first
loaders ran; over the rows read before the last checkpoint and after its resume (all ranks), a row missing or twice;
a rank's fds, threads, mapped files or children grown between its sample after the first checkpoint and its sample
after ``--settle-s`` without faults (RSS: more than 64 MiB); a process left after close; a rank with nothing for
``--stall-s`` (its stacks, exit status 3).

Usage: ``python tests/soak/nodesoak.py --ranks 2 --events 200 --seed 7 --way positions [--redis-url URL]``;
tests/soak/test_nodesoak.py runs a few faults each way; docs/soak.md has long runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queues
import random
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import psutil

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent / "integration"), str(_HERE.parent)]  # soak, datasets, sigint_gate
from datasets import PassIds  # noqa: E402  (the path above)
from sigint_gate import Gate  # noqa: E402  (the path above)
from soak import (  # noqa: E402  (the path above)
    EVENTS,
    Faulting,
    RowCounts,
    Watchdog,
    _padded,
    exactness,
    finish,
    resource_growth,
    signalled,
)

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader  # noqa: E402  (the path above)
from gigashuffle.errors import CheckpointError  # noqa: E402  (the path above)
from gigashuffle.host.parentdeath import set_parent_death_signal  # noqa: E402  (the path above)
from gigashuffle.procs.zygotereuse import parked_zygote_pid  # noqa: E402  (the path above)

NODE_EVENTS = (*EVENTS, "ctrl_c_one_rank")
_RETAKES = 4  # calls of one checkpoint on every rank before the soak gives up on it
_SENT_BATCHES = 32  # a resumed rank sends the parent its rows this many batches at a time


class Node:
    """What the parent shares with its ranks: a barrier, each rank's last call's outcome, a queue home, a stop."""

    def __init__(self, ctx: Any, ranks: int) -> None:
        self.ranks = ranks
        self.parent = os.getpid()  # a rank dies with it (a killed soak leaves no rank reading on)
        self.barrier = ctx.Barrier(ranks)
        self.ok = ctx.Array("b", ranks)
        self.results = ctx.Queue()
        self.stop = ctx.Event()


def _config(args: argparse.Namespace, queue: str, rank: int) -> DataloaderConfig:
    return DataloaderConfig(
        bs=args.bs, shuffle_size=args.shuffle_size, queue_name=queue, num_writers=2, num_readers=2,
        redis_url=args.redis_url or None, checkpoint_rows=args.way, max_restarts=1_000_000,
        lock_stripes=args.lock_stripes,
        local_rank=rank, global_rank=rank, local_world_size=args.ranks, global_world_size=args.ranks,
    )  # fmt: skip


class Rank(Faulting):
    """One rank of the first loaders: reads, does its part of each fault, keeps the last checkpoint every rank took."""

    def __init__(self, args: argparse.Namespace, rank: int, queue: str, node: Node) -> None:
        self.args, self.rank, self.queue, self.node = args, rank, queue, node
        self.schedule = random.Random(args.seed)  # the same on every rank: which fault, whose, how many batches
        self.rng = random.Random(args.seed * 1000 + rank + 1)  # this rank's: which child, the signals' delays
        self.handler = Gate()
        writers = 2 * args.ranks
        self.read, self.counted = RowCounts(args.ids, writers), RowCounts(args.ids, writers)
        self.part: dict[str, Any] | None = None
        self.events: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []
        self.samples: list[dict[str, int]] = []
        self.details: list[dict[str, collections.Counter[str]]] = []
        self.watchdog = Watchdog(args.stall_s)

    def _meet(self) -> None:
        try:
            self.node.barrier.wait(timeout=self.args.stall_s)
        except threading.BrokenBarrierError:
            raise SystemExit(f"nodesoak: rank {self.rank}: the other ranks did not meet within --stall-s") from None
        self.watchdog.beat()

    def _call(self, loader: MultiprocessShuffledDataloader, interrupt: bool, victim: int) -> dict[str, Any] | None:
        try:
            with signalled(self.handler, self.rng, interrupt, victim):
                return loader.state_dict()
        except KeyboardInterrupt:
            self.events["interrupted"] += 1
        except CheckpointError as exc:
            self.events["checkpoint_error"] += 1
            if len(self.errors) < 20:
                self.errors.append(str(exc)[:400])
        return None

    def checkpoint(self, loader: MultiprocessShuffledDataloader, interrupt: bool = False, victim: int = 0) -> None:
        """One checkpoint of the node: kept once every rank's call returned, else called again on every rank."""
        for _ in range(_RETAKES):
            part = self._call(loader, interrupt, victim)
            self.node.ok[self.rank] = part is not None
            self._meet()
            everyone = all(self.node.ok)
            self._meet()  # nobody writes its next outcome before every rank read these
            if everyone:
                assert part is not None
                self.part, self.counted = part, self.read.copy()
                return
            self.events["retaken"] += 1
            interrupt, victim = False, 0
        raise SystemExit(f"nodesoak: rank {self.rank}: {_RETAKES} calls of one checkpoint failed: {self.errors[-3:]}")

    def _event(self, loader: MultiprocessShuffledDataloader) -> None:
        event = self.schedule.choice(NODE_EVENTS)
        whose = self.schedule.randrange(self.args.ranks)  # drawn for every event: the schedule stays the seed's
        self.events[event] += 1
        mine = whose == self.rank
        if event in ("kill_writer", "kill_reader"):
            if mine:
                self._kill_one(loader, event.removeprefix("kill_"))
        elif event == "checkpoint":
            self.checkpoint(loader)
        elif event == "kill_in_checkpoint":
            self.checkpoint(loader, victim=self._child(loader, "writer", "reader") if mine else 0)
        else:
            self.checkpoint(loader, interrupt=mine or event == "ctrl_c_checkpoint")

    def _read(self, batches: Any, count: int) -> None:
        for _ in range(count):
            group = next(batches)[0]
            again = self.read.add(self.read.index(group["pass"].numpy(), group["id"].numpy()))
            if again:
                raise SystemExit(f"nodesoak: rank {self.rank}: {again} rows came to it twice ({dict(self.events)})")
            self.watchdog.beat()

    def _read_for(self, batches: Any, seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            self._read(batches, 1)

    def run(self) -> dict[str, Any]:
        args, me = self.args, psutil.Process()
        with MultiprocessShuffledDataloader(PassIds(args.ids, args.chunk), _config(args, self.queue, self.rank)) as ld:
            batches = iter(ld)
            self._read(batches, 1)
            self._read_for(batches, args.warmup_s)
            # What the first checkpoint maps for good is mapped before the first sample, and so is what a wide op of
            # the table opens for good (stats(): each stripe lock's own file description, NOTE [ Stripe locks ]).
            self.checkpoint(ld)
            ld.stats()
            self._sample(me)
            for _ in range(args.events):
                self._read(batches, self.schedule.randint(0, 2 * args.event_batches))
                self._event(ld)
            self._read_for(batches, args.settle_s)
            self._sample(me)
            self.checkpoint(ld)
        self._meet()  # every rank closed: the last one stopped the embedded server (whichever rank's child it is)
        self.watchdog.stop()
        return self._report()

    def _report(self) -> dict[str, Any]:
        growth, failures = resource_growth(self.samples, self.details, f"rank {self.rank}")
        # The embedded server's keeper is a child of the rank that started the server, and exits once the node's last
        # user stopped it: when that was another rank, it waits here as a zombie (reaped, and counted). While another
        # job of this machine uses the server (another soak), the keeper and its server go on: not this run's.
        until, reaped = time.monotonic() + 15.0, 0
        while (left := _left_children()) and time.monotonic() < until:
            for child in left:
                with contextlib.suppress(psutil.NoSuchProcess, ChildProcessError):
                    if child.ppid() == os.getpid() and child.status() == psutil.STATUS_ZOMBIE:
                        reaped += os.waitpid(child.pid, os.WNOHANG)[0] == child.pid
            time.sleep(0.1)
        if left:
            failures.append(f"rank {self.rank}: processes left after close: {[(p.pid, p.name()) for p in left]}")
        return {
            "rank": self.rank, "read": self.read.counts, "counted": self.counted.counts, "part": self.part,
            "events": dict(self.events), "errors": self.errors, "growth": growth, "failures": failures,
            "stray_sigint": self.handler.stray, "zombies_reaped": reaped,
        }  # fmt: skip


def _left_children() -> list[psutil.Process]:
    """This process's descendants, less a live embedded server and its keeper (shared by the machine's jobs) and
    the parked zygote (one per process: NOTE [ Reused zygotes ] in procs/zygotereuse.py)."""
    left = []
    parked = parked_zygote_pid()
    for child in psutil.Process().children(recursive=True):
        if child.pid == parked:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            shared = child.status() != psutil.STATUS_ZOMBIE and any(
                "gigashuffle.control.keeper" in part or part.endswith("-server") for part in child.cmdline()[:3]
            )
            if not shared:
                left.append(child)
    return left


def _first(args: argparse.Namespace, rank: int, queue: str, node: Node) -> None:
    set_parent_death_signal(node.parent)
    faulthandler.enable()
    soak = Rank(args, rank, queue, node)
    signal.signal(signal.SIGINT, soak.handler)
    # Pickled here, with the standard pickler: through the queue's, torch's tensors in the part would go as shared
    # memory whose fds the parent fetches from this process, which has ended by then.
    node.results.put(("first", rank, pickle.dumps(soak.run())))


def _resumed(args: argparse.Namespace, rank: int, queue: str, node: Node, checkpoint: dict[str, Any]) -> None:
    """A rank of the resumed job: sends the parent its rows until the parent says stop."""
    set_parent_death_signal(node.parent)
    faulthandler.enable()
    counts = RowCounts(args.ids, 2 * args.ranks)
    with MultiprocessShuffledDataloader(PassIds(args.ids, args.chunk), _config(args, queue, rank)) as loader:
        loader.load_state_dict(checkpoint)
        batches = iter(loader)
        sent: list[np.ndarray] = []
        while not node.stop.is_set():
            group = next(batches)[0]
            sent.append(counts.index(group["pass"].numpy(), group["id"].numpy()))
            if len(sent) >= _SENT_BATCHES:
                node.results.put(("rows", rank, np.concatenate(sent)))
                sent = []
        if sent:
            node.results.put(("rows", rank, np.concatenate(sent)))
    node.results.put(("done", rank, None))


def _start(ctx: Any, target: Any, args: argparse.Namespace, *rest: Any) -> list[Any]:
    procs = [ctx.Process(target=target, args=(args, rank, *rest), name=f"nodesoak-rank{rank}") for rank in
             range(args.ranks)]  # fmt: skip
    for proc in procs:
        proc.start()
    return procs


def _get(node: Node, procs: list[Any], deadline: float) -> tuple[str, int, Any]:
    """The next message of a rank; an exit if a rank ended without one or the deadline passed."""
    while time.monotonic() < deadline:
        try:
            return node.results.get(timeout=1.0)  # type: ignore[no-any-return]
        except queues.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"nodesoak: {[(p.name, p.exitcode) for p in dead]} ended early") from None
    raise SystemExit("nodesoak: the ranks sent nothing before the deadline")


def _join(procs: list[Any], deadline: float) -> None:
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            proc.kill()
            raise SystemExit(f"nodesoak: {proc.name} did not end")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="trainer processes of the node (local ranks)")
    p.add_argument("--events", type=int, default=40, help="faults")
    p.add_argument("--event-batches", type=int, default=400, help="mean batches each rank reads before a fault")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--way", choices=("saved", "positions"), default="saved", help="DataloaderConfig.checkpoint_rows")
    p.add_argument("--redis-url", default="", help="a Redis to use (default: the embedded server)")
    p.add_argument("--ids", type=int, default=4000, help="rows per writer and pass")
    p.add_argument("--chunk", type=int, default=50)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--shuffle-size", type=int, default=1024)
    p.add_argument("--lock-stripes", type=int, default=1, help="DataloaderConfig.lock_stripes (NOTE [ Stripes ])")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--stall-s", type=float, default=150.0, help="a rank with nothing for this long hangs")
    p.add_argument("--drain-past", type=int, default=512)
    p.add_argument("--drain-s", type=float, default=300.0, help="the resume's deadline")
    p.add_argument("--deadline-s", type=float, default=7200.0, help="the whole run's")
    p.add_argument(
        "--failpoints", default="",
        help="GIGASHUFFLE_FAILPOINTS for every process of the node (procs/failpoints.py), e.g. "
        "'cut.before_buffer_copy=1:sleep=0.05': local rank 0's copy in every cut that slow (a slow step the node "
        "barrier must wait for)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.failpoints:  # read once by every process started from now on (the ranks are spawned)
        os.environ["GIGASHUFFLE_FAILPOINTS"] = args.failpoints
    ctx = mp.get_context("spawn")  # fresh interpreters, as torchrun's ranks are
    deadline = time.monotonic() + args.deadline_s
    queue, node = f"nodesoak-{uuid.uuid4().hex[:8]}", Node(ctx, args.ranks)
    writers = 2 * args.ranks

    procs = _start(ctx, _first, args, queue, node)
    firsts: dict[int, dict[str, Any]] = {}
    while len(firsts) < args.ranks:
        _kind, rank, report = _get(node, procs, deadline)
        firsts[rank] = pickle.loads(report)
    _join(procs, deadline)
    size = max(len(r["read"]) for r in firsts.values())
    read = sum(_padded(r["read"], size).astype(np.int64) for r in firsts.values())
    counted = RowCounts(args.ids, writers)
    counted.counts = sum(_padded(r["counted"], size).astype(np.int64) for r in firsts.values())  # type: ignore[assignment]
    checkpoint: dict[str, Any] = {}
    for report in firsts.values():
        checkpoint.update(report["part"])
    failures = [f for r in firsts.values() for f in r["failures"]]
    twice_running = int(np.count_nonzero(read > 1))
    if twice_running:
        failures.append(f"{twice_running} rows came twice (to one rank or two) while the first loaders ran")

    begun = counted.begun()
    missing = set(np.flatnonzero(begun & (counted.counts == 0)).tolist())
    after = RowCounts(args.ids, writers)
    drained_by = time.monotonic() + args.drain_s  # then the rows still missing are lost: the report says which
    deadline = min(deadline, drained_by + args.stall_s)
    procs = _start(ctx, _resumed, args, queue, node, checkpoint)
    done: set[int] = set()
    past = 0
    while len(done) < args.ranks:
        kind, rank, rows = _get(node, procs, deadline)
        if kind == "done":
            done.add(rank)
            continue
        after.add(rows)
        if missing:
            missing.difference_update(rows.tolist())
        else:
            past += len(rows)
        if past >= args.drain_past or time.monotonic() > drained_by:
            node.stop.set()
    _join(procs, deadline)

    lost, twice, failed = exactness(counted, after)
    failures += failed
    events: collections.Counter[str] = collections.Counter()
    for r in firsts.values():
        events.update({k: v for k, v in r["events"].items() if k not in NODE_EVENTS})
    report = {
        "seed": args.seed, "way": args.way, "lock_stripes": args.lock_stripes, "ranks": args.ranks,
        "kinds": list(NODE_EVENTS),
        "events": {k: v for k, v in firsts[0]["events"].items() if k in NODE_EVENTS},
        "outcomes_all_ranks": dict(events),
        "rows_before_last_checkpoint": int(counted.counts.sum()), "rows_after_resume": after.total(),
        "rows_checked": int(begun.sum()), "lost": lost, "twice": twice,
        "growth": {r: firsts[r]["growth"] for r in sorted(firsts)}, "errors": firsts[0]["errors"][:3],
        "zombies_reaped": sum(r["zombies_reaped"] for r in firsts.values()),
        "failures": failures,
    }  # fmt: skip
    return finish("nodesoak", report)


if __name__ == "__main__":
    sys.exit(main())
