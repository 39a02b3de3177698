"""Training processes for tests/chaos/test_ctrl_c.py: what a script does around Ctrl-C, run as a real interpreter.

``storm URL QUEUE STORM_S DEADLINE_S``: a trainer that catches ``KeyboardInterrupt`` and iterates on with a new
iterator, under a thread that sends it SIGINT every 0.5-10 ms for ``STORM_S`` seconds. Its own SIGINT handler (the one
the loader chains to) raises only while the script is inside ``loader.stats()``, ``next(it)`` or the drop of a held
batch, so every interrupt lands in a loader call or a batch's release. Then, with the storm over, it drops every
batch and checks, with deadlines, that each reader's whole ring comes back as ready batches (no ring slot lost),
that the node lock is free, and that 200 more batches arrive. Prints one JSON line.

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
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader


class Rows(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        info = get_worker_info()
        base = (0 if info is None else info.id) * 10**9
        n = 0
        while True:
            yield [{"id": torch.arange(base + n, base + n + 16, dtype=torch.int64)}]
            n += 16


class Gate:
    """The script's SIGINT handler: raise only while ``armed`` (inside a loader call), else count a stray one."""

    def __init__(self) -> None:
        self.armed = False
        self.raised = 0
        self.stray = 0

    def __call__(self, signum: int, frame: object) -> None:
        if self.armed:
            self.raised += 1
            raise KeyboardInterrupt
        self.stray += 1


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
    table = sup.table()
    lock_free = table is not None and table.lock_holder() is None
    stats = loader.stats()
    it = iter(loader)
    after = 0
    while after < 200 and time.monotonic() < deadline:
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
    elif mode == "no_close":
        no_close(args[0])
    elif mode == "interrupted":
        interrupted(args[0])
    elif mode == "exit_joins_a_thread":
        exit_joins_a_thread(args[0])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
