"""``MetricsReader`` turns the children's shared counters into rates and shares: checked on counters made in this
process (the arithmetic of NOTE [ Metrics ], without a loader)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.shm import counters as cc
from gigashuffle.shm.counters import ChildCounters
from gigashuffle.trainer.metrics import MetricsReader


def _child(role: str, index: int, pid: int) -> ChildProcess:
    child = ChildProcess(role, index, seq=index, channel=None, pid=pid)  # type: ignore[arg-type]
    child.counters = ChildCounters()
    return child


def _cells(child: ChildProcess) -> Any:
    assert child.counters is not None
    return child.counters.cells


def test_writer_rates_and_shares_are_over_the_interval() -> None:
    writer = _child("writer", 0, pid=101)
    reader = MetricsReader("q", 0, shuffle_size=100, bs=4)
    _cells(writer)[cc.W_ROWS] = 1000  # before the first reading: counted from the writer's start
    first = reader.read([writer], None, restarts=0)
    assert first.writers[0].rows == 1000 and first.writers[0].rows_per_s > 0
    time.sleep(0.2)
    cells = _cells(writer)
    cells[cc.W_DATASET_S] += 0.1  # half of a 0.2 s interval inside the dataset
    cells[cc.W_BLOCKED_S] += 0.05
    second = reader.read([writer], None, restarts=1)
    (w,) = second.writers
    assert w.rows_per_s == 0.0  # no row since the last reading, whatever the total
    assert 0.2 <= second.interval_s < 5
    assert w.in_dataset == pytest.approx(0.1 / second.interval_s)
    assert w.blocked == pytest.approx(0.05 / second.interval_s)
    assert second.restarts == 1


def test_reader_fill_mean_min_and_a_fresh_minimum_each_interval() -> None:
    child = _child("reader", 0, pid=202)
    reader = MetricsReader("q", 0, shuffle_size=100, bs=4)
    counters = child.counters
    assert counters is not None
    for full in (80, 20, 50):
        counters.sample_fill(full)
    m = reader.read([child], None, restarts=0)
    assert m.fill_mean == pytest.approx(0.5) and m.fill_min == pytest.approx(0.2) and m.fill_samples == 3
    counters.sample_fill(90)  # the read asked for a fresh minimum: the old 20 no longer counts
    counters.sample_fill(70)
    m = reader.read([child], None, restarts=0)
    assert m.fill_mean == pytest.approx(0.8) and m.fill_min == pytest.approx(0.7)


def test_reader_gather_starved_and_age() -> None:
    child = _child("reader", 0, pid=303)
    reader = MetricsReader("q", 0, shuffle_size=100, bs=4)
    reader.read([child], None, restarts=0)
    cells = _cells(child)
    cells[cc.R_BATCHES] += 10
    cells[cc.R_GATHER_S] += 0.001
    cells[cc.R_AGE_SUM] += 40 * 25
    cells[cc.R_AGE_N] += 40
    m = reader.read([child], None, restarts=0)
    assert m.gather_per_batch_s == pytest.approx(0.0001)
    assert m.row_age_rows == pytest.approx(25)
    assert math.isnan(m.row_age_s)  # no table: no node write rate to turn rows into seconds
    assert math.isnan(m.fill_mean)  # no draw and no table to sample


def test_trainer_wait_and_rows() -> None:
    reader = MetricsReader("q", 0, shuffle_size=100, bs=4)
    reader.read([], None, restarts=0)
    reader.batches += 5
    reader.wait_s += 0.01
    m = reader.read([], None, restarts=0)
    assert m.batches == 5 and m.wait_per_batch_s == pytest.approx(0.002)
    assert m.rows_per_s == pytest.approx(20 / m.interval_s)


def test_writers_per_batch_and_host_to_device_over_the_interval() -> None:
    child = _child("reader", 0, pid=404)
    reader = MetricsReader("q", 0, shuffle_size=100, bs=4)
    cells = _cells(child)
    cells[cc.R_WRITERS_SUM] += 30  # before the first reading: counted from the reader's start
    cells[cc.R_WRITERS_N] += 10
    first = reader.read([child], None, restarts=0, h2d=(0.5, 100))
    assert first.writers_per_batch == pytest.approx(3.0) and first.h2d_per_batch_s == pytest.approx(0.005)
    cells[cc.R_WRITERS_SUM] += 4
    cells[cc.R_WRITERS_N] += 4
    m = reader.read([child], None, restarts=0, h2d=(0.6, 150))
    assert m.writers_per_batch == pytest.approx(1.0)  # this interval's batches only
    assert m.h2d_per_batch_s == pytest.approx(0.002)
    assert reader.read([child], None, restarts=0).h2d_per_batch_s is None  # no device
