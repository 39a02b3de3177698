"""A writer's pending rows (NOTE [ Deferred commits ] in procs/pending.py) on a real slot table, without a loader.

The watcher thread is what keeps rows from staying invisible while a writer's dataset waits, so these tests wait
for it (polls with a deadline) rather than calling it.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from slot_audit import snapshot

from gigashuffle.procs.pending import PendingRows, rows_per_commit
from gigashuffle.shm.slottable import EMPTY, FULL, WRITING, SlotTable

_WAIT_S = 30.0


def _wait_for_full(table: SlotTable, full: int) -> float:
    """Seconds until ``full`` slots are full (a poll with a deadline)."""
    start = time.monotonic()
    while table.counts()[2].full != full:
        if time.monotonic() - start > _WAIT_S:
            raise TimeoutError(f"{table.counts()[2]} after {_WAIT_S} s, waiting for {full} full slots")
        time.sleep(0.001)
    return time.monotonic() - start


@pytest.mark.parametrize(
    ("chunk_rows", "slots", "expected"),
    [(64, 16384, 256), (1024, 65536, 4096), (64, 4096, 256), (4, 64, 4), (16, 128, 16), (100, 100, 100)],
)
def test_rows_per_commit_is_four_chunks_at_most_a_sixteenth_of_the_buffer_never_under_a_chunk(
    chunk_rows: int, slots: int, expected: int
) -> None:
    assert rows_per_commit(chunk_rows, slots) == expected


def test_rows_left_pending_are_published_by_the_watcher_while_the_writer_is_elsewhere() -> None:
    table, me = SlotTable(64, seed=0), os.getpid()
    with PendingRows(table, me, publish_within_s=0.01) as pending:
        ids = table.acquire_empty(me, 8)
        pending.add(ids)
        assert table.counts()[2].full == 0, "rows are pending, not published, right after the copy"
        _wait_for_full(table, 8)  # the writer never calls publish(): the watcher must
        assert pending.rows == 0
        assert (table.state[ids] == FULL).all() and (table.version[ids] > 0).all()
        assert snapshot(table).writing == 0


def test_publish_and_reserve_publishes_everything_pending_and_reserves_the_next_rows_in_one_call() -> None:
    table, me = SlotTable(64, seed=0), os.getpid()
    with PendingRows(table, me, publish_within_s=60.0) as pending:  # a watcher too slow to interfere
        first, second = table.acquire_empty(me, 4), table.acquire_empty(me, 4)
        pending.add(first)
        pending.add(second)
        assert pending.rows == 8
        fresh = pending.publish_and_reserve(16, min_full=0)
        assert len(fresh) == 16 and (table.state[fresh] == WRITING).all()
        assert (table.state[np.concatenate([first, second])] == FULL).all()
        assert table.counts()[2].full == 8 and pending.rows == 0
        # Nothing to reserve: it still publishes.
        pending.add(fresh[:4])
        assert len(pending.publish_and_reserve(0, min_full=0)) == 0
        assert table.counts()[2].full == 12


def test_publish_and_reserve_reserves_nothing_that_would_keep_the_buffer_from_min_full() -> None:
    table, me = SlotTable(16, seed=0), os.getpid()
    with PendingRows(table, me, publish_within_s=60.0) as pending:
        pending.add(table.acquire_empty(me, 4))
        assert len(pending.publish_and_reserve(8, min_full=16)) == 0, "fill_once: no reservation ahead"
        assert table.counts()[2].full == 4 and snapshot(table).writing == 0


def test_close_publishes_what_is_pending_and_stops_the_watcher_and_is_safe_twice() -> None:
    table, me = SlotTable(32, seed=0), os.getpid()
    pending = PendingRows(table, me, publish_within_s=60.0)
    pending.add(table.acquire_empty(me, 5))
    pending.close()
    pending.close()
    assert table.counts()[2].full == 5
    assert not pending._thread.is_alive()


def test_a_failure_in_the_watcher_is_raised_in_the_writer_at_its_next_call() -> None:
    table, me = SlotTable(32, seed=0), os.getpid()
    pending = PendingRows(table, me, publish_within_s=0.01)
    ids = table.acquire_empty(me, 4)
    table.give_back(me, ids)  # the slots are no longer this writer's: publishing them must not pass silently
    pending.add(ids)
    deadline = time.monotonic() + _WAIT_S
    while pending._thread.is_alive():
        assert time.monotonic() < deadline, "the watcher should have stopped on the error"
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match="publishing pending rows failed") as info:
        pending.add(ids)
    assert isinstance(info.value.__cause__, AssertionError)
    assert (table.state[ids] == EMPTY).all()
    pending.close()  # the error was reported: close does not raise it again
