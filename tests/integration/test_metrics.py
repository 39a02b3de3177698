"""``loader.metrics()`` in the three situations docs/waiting-on-data.md reads: a slow dataset (the trainer waits,
writers sit in the dataset), a slow trainer (no wait, writers blocked on a full buffer), a stopped writer (its
rows/s drops to 0). Bounds are wide: the machine is shared, and only the direction of each figure is the claim."""

from __future__ import annotations

import math
import os
import signal
import time
import uuid
from typing import Any

import pytest
import torch
from datasets import DEADLINE_S, SlowUniqueIds, UniqueIds, poll, take, wait_for

from gigashuffle import DataloaderConfig, GigashuffleError, MultiprocessShuffledDataloader
from gigashuffle.host.pids import is_stopped
from gigashuffle.promtext import SAMPLE_LINE


def _config(redis_url: str, **overrides: Any) -> DataloaderConfig:
    settings: dict[str, Any] = dict(
        bs=8, shuffle_size=128, queue_name=f"metrics-{uuid.uuid4().hex[:8]}", num_writers=1, num_readers=1,
        redis_url=redis_url, min_mixing=0.1,
    )  # fmt: skip
    settings.update(overrides)
    return DataloaderConfig(**settings)


def _warm(loader: MultiprocessShuffledDataloader, n: int = 10) -> Any:
    it = iter(loader)
    take(it, n)
    # A writer's counters arrive with its Attached message, which the trainer reads while it takes batches.
    poll(it, lambda _b: len(loader.metrics().writers) == loader.config.num_writers, "every writer's counters")
    return it


def test_slow_dataset_shows_waiting_trainer_and_writers_in_the_dataset(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(SlowUniqueIds(chunk=8, sleep_s=0.02), _config(redis_url)) as loader:
        it = _warm(loader)
        loader.metrics(max_age_s=0)  # the interval starts here (a fresh reading)
        take(it, 30)
        m = loader.metrics(max_age_s=0)
    assert m.batches >= 40 and m.wait_s > 0
    assert m.wait_share > 0.5, m  # the trainer waits for data most of the time
    assert m.wait_per_batch_s > 0.005, m  # a batch is two chunks of 20 ms sleep away
    (writer,) = m.writers
    assert writer.in_dataset > 0.5 and writer.blocked < 0.2, m
    assert writer.rows_per_s > 0 and m.rows_per_s > 0
    assert m.readers_starved > 0.3, m  # the readers too wait for rows
    assert m.restarts == 0


def test_slow_trainer_shows_no_wait_and_writers_blocked_on_a_full_buffer(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url)) as loader:
        it = _warm(loader)
        wait_for(lambda: loader.stats().full >= 100, "the buffer to fill again after the warm-up")
        loader.metrics(max_age_s=0)
        for _ in range(20):
            next(it)
            time.sleep(0.05)  # the training step: the trainer, not the data, is the bound
        m = loader.metrics(max_age_s=0)
    assert m.wait_share < 0.3, m
    (writer,) = m.writers
    assert writer.blocked > 0.5 and writer.in_dataset < 0.3, m
    assert m.fill_mean > 0.5 and 0 <= m.fill_min <= m.fill_mean, m  # the buffer stays mostly full
    assert m.fill_samples > 0, m  # sampled by the reader at its draws (one per batch the trainer frees)
    assert 0 <= m.lock_busy_share < 0.5, m
    assert not math.isnan(m.row_age_rows) and m.row_age_rows > 0, m
    assert m.writers_per_batch == 1.0, m  # one writer: every batch has one
    assert m.h2d_per_batch_s is None, m  # no device


def test_stopped_writer_rows_per_s_drops_to_zero_and_a_killed_one_counts_as_a_restart(redis_url: str) -> None:
    cfg = _config(redis_url, num_writers=2, max_restarts=1)
    with MultiprocessShuffledDataloader(UniqueIds(), cfg) as loader:
        it = _warm(loader)
        table = loader._sup.table()
        assert table is not None
        victim = _stop_a_writer_not_holding_the_lock(loader, table)
        try:
            loader.metrics(max_age_s=0)
            # Three buffers' worth of rows: whatever the machine's load, the other writer must write in this interval.
            take(it, 3 * cfg.shuffle_size // cfg.bs)
            m = loader.metrics(max_age_s=0)
        finally:
            os.kill(victim, signal.SIGCONT)
        assert 1.0 <= m.writers_per_batch <= 2.0, m
        by_pid = {w.pid: w for w in m.writers}
        assert by_pid[victim].rows_per_s == 0.0, m
        (other,) = (w for pid, w in by_pid.items() if pid != victim)
        assert other.rows_per_s > 0, m
        os.kill(victim, signal.SIGKILL)
        poll(it, lambda _b: loader.metrics().restarts == 1, "the restart in metrics()")


def _stop_a_writer_not_holding_the_lock(loader: MultiprocessShuffledDataloader, table: Any) -> int:
    """SIGSTOP a writer; one stopped inside the node lock would stop the node (NOTE [ A stopped lock holder ]),
    which is another test's subject: let it go on and try again."""
    victim = loader.child_pids()["writer"][1]
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        os.kill(victim, signal.SIGSTOP)
        wait_for(lambda: is_stopped(victim), "the writer to stop", interval_s=0.001)
        if table.lock_holder() != victim:
            return victim
        os.kill(victim, signal.SIGCONT)
    raise TimeoutError("the writer was always stopped holding the node lock")


def test_wait_shows_in_a_profiler_trace(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(SlowUniqueIds(chunk=8, sleep_s=0.02), _config(redis_url)) as loader:
        it = iter(loader)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            take(it, 5)
    assert any(event.name == "gigashuffle.wait" for event in prof.events())


def test_prometheus_text(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, num_writers=2)) as loader:
        _warm(loader)
        text = loader.metrics().to_prometheus()
    lines = text.splitlines()
    queue = loader.config.queue_name
    assert f'gigashuffle_batches_total{{queue="{queue}",rank="0"}} ' in text
    assert "# TYPE gigashuffle_wait_seconds_total counter" in lines
    for writer in (0, 1):
        assert any(line.startswith(f'gigashuffle_writer_rows_per_second{{queue="{queue}",rank="0",writer="{writer}"}}')
                   for line in lines)  # fmt: skip
    for line in lines:
        if not line.startswith("#"):
            assert SAMPLE_LINE.match(line), line  # the line format a scraper parses
            float(line.rsplit(" ", 1)[1])  # every sample is a number (NaN included)


def test_metrics_of_a_closed_loader_raise(redis_url: str) -> None:
    loader = MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url))
    loader.close()
    with pytest.raises(GigashuffleError, match="closed"):
        loader.metrics()


def test_two_writers_mix_in_a_batch_and_a_cached_reading_between_fresh_ones(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, num_writers=2)) as loader:
        it = _warm(loader)
        # Both writers' rows reach the buffer within a few batches: a batch of 8 random rows then mixes them.
        m = poll(it, lambda _b: loader.metrics(max_age_s=0).writers_per_batch > 1.2, "batches of both writers")
        m = loader.metrics(max_age_s=60)  # younger than a minute: the last reading, unchanged
        assert m is loader.metrics(max_age_s=60) and 1.2 < m.writers_per_batch <= 2.0, m
        take(it, 2)
        again = loader.metrics(max_age_s=60)
        assert again is m and again.batches == m.batches, "a cached reading is not updated"
        fresh = loader.metrics(max_age_s=0)
        assert fresh is not m and fresh.taken_at > m.taken_at and fresh.batches >= m.batches + 2
        with pytest.raises(ValueError, match="max_age_s"):
            loader.metrics(max_age_s=-1)
