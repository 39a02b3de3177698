"""A loader used from two threads: a training loop in ``next()`` and a monitor beside it.

``child_pids()`` pumps the supervisor until a respawned child's pid is known, and the chaos tests' killer calls it
from a second thread while the main thread trains. With only the pump locked, the monitor's pump flushed one
reader's unsent ring slots while the loop's ``next()`` flushed them too: a ``KeyError`` in
``DroppedBatches.due``, or a slot appended to a list the other thread had just sent, which is lost for good, and
after ``ring_depth`` such losses the reader is starved and ``next()`` waits forever (a CI run's 60 s hang).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from datasets import GatedUniqueIds, UniqueIds, check_unique_batch
from timing import deadline

from gigashuffle import CheckpointError, DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.loader import checkpointing

BATCHES = 2000
LIMIT_S = 120.0  # the loop's whole run; a starved reader would leave next() waiting without end


def test_a_monitor_thread_that_pumps_beside_next_loses_no_ring_slot(redis_url: str) -> None:
    cfg = DataloaderConfig(bs=4, shuffle_size=64, queue_name=f"threads-{uuid.uuid4().hex[:8]}", num_writers=1,
                           num_readers=2, ring_depth=2, redis_url=redis_url)  # fmt: skip
    stop = threading.Event()
    pumps = [0]
    errors: list[BaseException] = []  # the monitor's exception, carried home
    with MultiprocessShuffledDataloader(UniqueIds(), cfg) as loader:
        loader.child_pids()

        def monitor() -> None:
            # What child_pids() runs while a respawned child's pid is unknown, back to back (the private pump: the
            # public call pumps only in that window), and the figures a monitoring thread reads.
            try:
                while not stop.is_set():
                    loader._sup.pump(0.0)
                    loader.metrics(0.0)
                    pumps[0] += 1
                    # Out of the turn a moment between pumps: back to back, this thread took the turn again before
                    # the woken loop could (a lock is not fair), and the loop starved (120 s for 2,000 batches on a
                    # slower VM; 5.5 s for the whole test with this pause).
                    stop.wait(0.0002)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=monitor, name="monitor", daemon=True)
        seen: set[int] = set()
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # the threads take turns every 10 us, not 5 ms: the windows get hit
        thread.start()
        try:
            with deadline(LIMIT_S, f"the training loop's {BATCHES} batches"):
                it = iter(loader)
                for _ in range(BATCHES):
                    ids = check_unique_batch(next(it), cfg.bs, cfg.shuffle_size)
                    assert seen.isdisjoint(ids), f"ids handed out twice: {sorted(seen.intersection(ids))[:8]}"
                    seen.update(ids)
                    if errors:
                        break
        finally:
            stop.set()
            thread.join(timeout=30.0)
            sys.setswitchinterval(switch)
        assert not thread.is_alive(), "the monitor thread did not stop within 30 s"
        assert not errors, f"the monitor thread failed: {errors[0]!r}"
        assert pumps[0] > 0, "the monitor never pumped: the test checked nothing"
        assert len(seen) == BATCHES * cfg.bs


def _held_elsewhere(lock: Any) -> bool:
    """Whether another thread holds ``lock`` now."""
    if lock.acquire(blocking=False):
        lock.release()
        return False
    return True


@contextlib.contextmanager
def _loop_inside_next(
    redis_url: str, tmp_path: Path
) -> Iterator[tuple[MultiprocessShuffledDataloader, Callable[[], None]]]:
    """A loader whose training loop, a thread of its own, waits inside ``next()`` holding the trainer's turn (the
    source gave one chunk; the readers need 32 full slots). Yields the loader and ``go()``, which lets the source go
    on and waits for that ``next()`` to return."""
    allowed = tmp_path / "allowed"
    allowed.write_text("1")
    cfg = DataloaderConfig(bs=4, shuffle_size=64, queue_name=f"threads-{uuid.uuid4().hex[:8]}", num_writers=1,
                           num_readers=1, redis_url=redis_url)  # fmt: skip
    with MultiprocessShuffledDataloader(GatedUniqueIds(str(allowed)), cfg) as loader:
        loader.child_pids()
        it = iter(loader)
        trainer = threading.Thread(target=lambda: next(it), name="loop", daemon=True)
        trainer.start()
        # next() takes the turn before its first pump; its wait then lasts until go(), far past this poll.
        deadline_at = time.monotonic() + LIMIT_S
        while not _held_elsewhere(loader._sup.turn):
            assert time.monotonic() < deadline_at, "next() never took the trainer's turn"
            time.sleep(0.01)

        def go() -> None:
            allowed.write_text("1000000")  # the source goes on: the buffer fills and next() returns
            trainer.join(LIMIT_S)
            assert not trainer.is_alive(), "next() did not return once the source went on"

        yield loader, go


def test_a_pump_from_another_thread_waits_while_next_waits(redis_url: str, tmp_path: Path) -> None:
    """The lock's boundary, without a race to hit: while the loop waits inside ``next()``, a monitor's pump (what
    ``child_pids()`` runs while a respawned child's pid is unknown) does not run until that ``next()`` has
    returned. A lock on the pump alone let it run between two of the loop's own pumps, beside the loop's flush and
    hand-over."""
    with _loop_inside_next(redis_url, tmp_path) as (loader, go):
        pumped = threading.Event()

        def monitor() -> None:
            loader._sup.pump(0.0)
            pumped.set()

        watcher = threading.Thread(target=monitor, name="monitor", daemon=True)
        watcher.start()
        assert not pumped.wait(1.0), "the monitor pumped while the loop was inside next()"
        go()
        assert pumped.wait(LIMIT_S), "the monitor's pump never ran once next() had returned"
        watcher.join(LIMIT_S)


def test_a_checkpoint_from_another_thread_beside_next_fails_clearly(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``state_dict()`` from a second thread while the loop waits inside ``next()``: the cut would pause the readers
    whose batch that ``next()`` waits for, and wait for the turn that ``next()`` holds. It waits a bounded time
    for the turn and then says which thread to call it from; once the loop is between steps it works."""
    monkeypatch.setattr(checkpointing, "_TURN_WAIT_S", 1.0)
    with _loop_inside_next(redis_url, tmp_path) as (loader, go):
        refused = pytest.raises(CheckpointError, match="call it from the thread that iterates the loader")
        with deadline(LIMIT_S, "state_dict() beside a thread inside next()"), refused:
            loader.state_dict()
        go()
        with deadline(LIMIT_S, "state_dict() with the loop between steps"):
            state = loader.state_dict()
        assert f"rank{loader.config.global_rank}" in state
