"""Training processes for tests/chaos/test_ctrl_c.py: what a script does around Ctrl-C, run as a real interpreter.

``storm URL QUEUE STORM_S DEADLINE_S``: a trainer that catches ``KeyboardInterrupt`` and iterates on with a new
iterator, under a thread that sends it SIGINT every 0.5-10 ms for ``STORM_S`` seconds. Its own SIGINT handler (the one
the loader chains to) raises only while the script is inside ``loader.stats()``, ``next(it)`` or the drop of a held
batch, so every interrupt lands in a loader call or a batch's release. Then, with the storm over, it drops every
batch and checks, with deadlines, that each reader's whole ring comes back as ready batches (no ring slot lost),
that the node lock is free, and how many of 200 more batches arrive before the deadline. Prints one JSON line.

``handler_storm URL QUEUE ARRANGEMENT STORM_S DEADLINE_S``: a script with its own SIGINT handler that raises
``KeyboardInterrupt`` wherever the signal lands, installed ``before`` the loader is built, ``after`` it, or
``chained`` (one before, and one after that calls the one it replaced), under a Ctrl-C about every 50 ms for
``STORM_S`` seconds while it calls ``loader.stats()`` and ``next(it)`` and drops batches, catching each interrupt
and carrying on with a new iterator. Then the same checks as ``storm``, and whether its handler is still installed.

``no_close QUEUE``: the embedded server, a few batches and ``loader.stats()``, then exit without ``close()``.
``interrupted QUEUE``: the embedded server, batches until Ctrl-C, no ``with`` and no ``close()``: prints ``READY``
and the pids of the loader's processes and of the server, then iterates until interrupted.
Both log the loader's "closed" line at DEBUG, so a test sees that the teardown at exit ran to its end.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.shm.slottable import SlotTable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared handler below
from sigint_gate import Gate


class Rows(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        info = get_worker_info()
        base = (0 if info is None else info.id) * 10**9
        n = 0
        while True:
            yield [{"id": torch.arange(base + n, base + n + 16, dtype=torch.int64)}]
            n += 16


def storm(url: str, queue: str, storm_s: float, deadline_s: float) -> None:
    gate = Gate()
    signal.signal(signal.SIGINT, gate)  # before the loader: its handler defers, then calls this one
    cfg = DataloaderConfig(
        bs=8, shuffle_size=512, queue_name=queue, num_writers=2, num_readers=2, ring_depth=2, redis_url=url
    )
    loader = MultiprocessShuffledDataloader(Rows(), cfg)
    stop = threading.Event()

    def send() -> None:
        rnd = random.Random(0)
        while not stop.wait(rnd.uniform(0.0005, 0.01)):
            os.kill(os.getpid(), signal.SIGINT)

    held: list[Any] = [next(iter(loader))]  # started, before the storm: start-up takes seconds
    delivered = caught = 0
    sender = threading.Thread(target=send, daemon=True)
    end = time.monotonic() + storm_s
    sender.start()
    while time.monotonic() < end:
        try:
            try:
                gate.armed = True
                it = iter(loader)
                while time.monotonic() < end:
                    loader.stats()
                    held.append(next(it))
                    delivered += 1
                    if len(held) > 2 or random.random() < 0.3:
                        del held[0]  # its ring slot's release runs here, under the storm
            finally:
                gate.armed = False
        except KeyboardInterrupt:
            caught += 1
    stop.set()
    sender.join()
    held.clear()
    result = {"caught": caught, "delivered_in_storm": delivered, "stray": gate.stray}
    result.update(_after_storm(loader, deadline_s))
    loader.close()
    print(json.dumps(result), flush=True)


def _after_storm(loader: MultiprocessShuffledDataloader, deadline_s: float) -> dict[str, Any]:
    sup = loader._sup
    deadline = time.monotonic() + deadline_s
    readers = sup.readers()
    depth = {id(c): c.ring.depth for c in readers if c.ring is not None}
    ready: collections.Counter[int] = collections.Counter()
    rings_whole = False
    while not rings_whole and time.monotonic() < deadline:
        sup.pump(0.05)
        ready = collections.Counter(id(c) for c, _k in sup.inbox.waiting())
        rings_whole = len(depth) == len(readers) == 2 and all(ready[key] == d for key, d in depth.items())
    held = [c.held for c in readers]  # now, before the batches below are read
    lock_free = _lock_seen_free(sup.table(), deadline)
    stats = loader.stats()
    it = iter(loader)
    after = 0
    while after < 200 and _ready_by(loader, deadline):  # next() would wait for ever on rings that lost slots
        next(it)
        after += 1
    return {
        "rings_whole": rings_whole,
        "ready_by_reader": sorted(ready.values()),
        "depths": sorted(depth.values()),
        "held": held,
        "lock_free": lock_free,
        "stats_full": stats.full,
        "after": after,
    }


def _lock_seen_free(table: SlotTable | None, deadline: float) -> bool:
    """Whether the node lock is seen free before ``deadline``. One look is not enough: the writers poll the full
    buffer under it, microseconds at a time, so a look can find a live writer holding it (the loader delivered on,
    so nothing had leaked). A hold the storm leaked in this process never ends."""
    while table is not None and time.monotonic() < deadline:
        if table.lock_holder() is None:
            return True
        time.sleep(0.001)
    return False


def _ready_by(loader: MultiprocessShuffledDataloader, deadline: float) -> bool:
    """Whether a batch is ready before ``deadline``, returning dropped batches' slots meanwhile as ``next()`` does."""
    sup = loader._sup
    while not sup.inbox.ready:
        if time.monotonic() >= deadline:
            return False
        loader._placement.poll()
        sup.inbox.flush()
        sup.pump(0.05)
    return True


class ScriptsHandler:
    """A "save on Ctrl-C" script's handler: counts, calls the handler it replaced if it chains, raises."""

    def __init__(self, chain_to: Any = None) -> None:
        self.calls = 0
        self.chain_to = chain_to

    def __call__(self, signum: int, frame: object) -> None:
        self.calls += 1
        if callable(self.chain_to):
            self.chain_to(signum, frame)
        raise KeyboardInterrupt


def handler_storm(url: str, queue: str, arrangement: str, storm_s: float, deadline_s: float) -> None:
    first = ScriptsHandler()
    if arrangement in ("before", "chained"):
        signal.signal(signal.SIGINT, first)
    cfg = DataloaderConfig(
        bs=8, shuffle_size=256, queue_name=queue, num_writers=1, num_readers=2, ring_depth=2, redis_url=url
    )
    loader = MultiprocessShuffledDataloader(Rows(), cfg)
    held: list[Any] = [next(iter(loader))]  # started, before the storm: start-up takes seconds
    handler: Any = first
    if arrangement == "after":
        signal.signal(signal.SIGINT, first)
    elif arrangement == "chained":
        handler = ScriptsHandler()
        handler.chain_to = signal.signal(signal.SIGINT, handler)
    # A plain flag, not an Event: the script's handler raises anywhere, and an interrupt inside Event.set() can leave
    # its lock held (see test_nodelock.py). Each signal lands in the main thread; the sender only sleeps and kills.
    stop = [False]

    def send() -> None:
        rnd = random.Random(0)
        while not stop[0]:
            time.sleep(rnd.uniform(0.03, 0.07))
            if not stop[0]:
                os.kill(os.getpid(), signal.SIGINT)

    delivered = caught = 0
    sender = threading.Thread(target=send, daemon=True)
    end = time.monotonic() + storm_s
    sender.start()
    while True:  # an interrupt lands anywhere, the script's own lines included: each one is caught and counted
        try:
            while time.monotonic() < end:
                try:
                    it = iter(loader)
                    while time.monotonic() < end:
                        loader.stats()
                        held.append(next(it))
                        delivered += 1
                        if len(held) > 1 or random.random() < 0.5:
                            del held[0]
                except KeyboardInterrupt:
                    caught += 1
            stop[0] = True
            sender.join()
            time.sleep(0.2)  # the last signal may still be on its way
            break
        except KeyboardInterrupt:
            caught += 1
    held.clear()
    result = {
        "caught": caught,
        "delivered_in_storm": delivered,
        "handler_calls": handler.calls,
        "handler_kept": signal.getsignal(signal.SIGINT) is handler,
    }
    result.update(_after_storm(loader, deadline_s))
    loader.close()
    print(json.dumps(result), flush=True)


LOADERS: list[MultiprocessShuffledDataloader] = []  # alive until the interpreter exits, as a script's globals are


def no_close(queue: str) -> None:
    cfg = DataloaderConfig(bs=8, shuffle_size=256, queue_name=queue, num_writers=1, num_readers=1)
    loader = MultiprocessShuffledDataloader(Rows(), cfg)
    LOADERS.append(loader)
    it = iter(loader)
    for _ in range(5):
        next(it)
    loader.stats()
    print("DONE", flush=True)


def interrupted(queue: str) -> None:
    cfg = DataloaderConfig(bs=8, shuffle_size=256, queue_name=queue, num_writers=1, num_readers=1)
    loader = MultiprocessShuffledDataloader(Rows(), cfg)
    it = iter(loader)
    for _ in range(5):
        next(it)
    loader.stats()
    server = loader._sup.link.server
    pids = [pid for pids in loader.child_pids().values() for pid in pids]
    if server is not None and server.process is not None:
        pids.append(server.process.pid)
    print("READY " + json.dumps(pids), flush=True)
    while True:
        next(it)


def _hold_the_exit() -> None:
    while threading.main_thread().is_alive():  # until the exit began: threading._shutdown stops the main thread
        time.sleep(0.01)
    print("EXITING", flush=True)  # the main thread now waits in threading._shutdown for this one
    sys.stdin.read()


def exit_joins_a_thread(queue: str) -> None:
    """Leave the loader open and a non-daemon thread that ends when stdin closes: the interpreter's exit waits in
    ``threading._shutdown`` (before any atexit callback) for the test to send its Ctrl-C there."""
    cfg = DataloaderConfig(bs=8, shuffle_size=256, queue_name=queue, num_writers=1, num_readers=1)
    loader = MultiprocessShuffledDataloader(Rows(), cfg)
    LOADERS.append(loader)
    it = iter(loader)
    for _ in range(5):
        next(it)
    threading.Thread(target=_hold_the_exit, name="joined-at-exit").start()
    pids = [pid for pids in loader.child_pids().values() for pid in pids]
    print("READY " + json.dumps(pids), flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("gigashuffle.trainer.supervisor").setLevel(logging.DEBUG)
    logging.getLogger("gigashuffle.procs.interrupts").setLevel(logging.DEBUG)
    mode, *args = sys.argv[1:]
    if mode == "storm":
        storm(args[0], args[1], float(args[2]), float(args[3]))
    elif mode == "handler_storm":
        handler_storm(args[0], args[1], args[2], float(args[3]), float(args[4]))
    elif mode == "no_close":
        no_close(args[0])
    elif mode == "interrupted":
        interrupted(args[0])
    elif mode == "exit_joins_a_thread":
        exit_joins_a_thread(args[0])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
