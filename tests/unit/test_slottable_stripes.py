"""A slot table split into stripes (NOTE [ Stripes ] in shm/stripes.py): draws as uniform as one table's, lanes and
counts exact over the stripes, wide ops over every stripe in stripe order, a wide op a holder died in rolled
forward by the next one-stripe op, versions unique over the table, and the stripe count checked.

No Redis and no loader: real shared memory, real locks, real forked processes killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from forked import fork_child as _fork
from forked import wait_child as _wait
from slot_audit import lock_is_free, repair_killed_in_the_journal

from gigashuffle.shm import journal
from gigashuffle.shm.buffer import SharedMemory
from gigashuffle.shm.nodelock import NodeLock
from gigashuffle.shm.slottable import EMPTY, FULL, READING, WRITING, SlotTable, table_nbytes
from gigashuffle.shm.stripes import default_stripes

LANE = 7


def _in_stripe(table: SlotTable, k: int, pid: int, n: int) -> np.ndarray:
    """``acquire_empty`` in stripe ``k`` (its choice of stripe is random)."""
    table._for_writer = lambda n: table._stripes[k]  # type: ignore[method-assign]
    try:
        return table.acquire_empty(pid, n)
    finally:
        del table._for_writer


def _fill(table: SlotTable, k: int, pid: int, n: int) -> np.ndarray:
    ids = _in_stripe(table, k, pid, n)
    assert table.commit_written(pid, ids) == len(ids) == n
    return ids


def _consistent(table: SlotTable) -> None:
    """Every stripe's counts against its states, and no journaled op left, under every lock."""
    with table._locked(wait_s=5.0):
        assert int(table._wide.header[journal.H_LENGTH]) == 0
        for stripe in table._stripes:
            states = table.state[stripe.lo : stripe.hi]
            assert int(stripe.header[journal.H_LENGTH]) == 0, stripe.k
            assert stripe.full() == np.count_nonzero(states == FULL), stripe.k
            assert stripe.empty() == np.count_nonzero(states == EMPTY), stripe.k


def test_the_stripe_count_is_checked_and_one_is_a_table() -> None:
    assert default_stripes(4096) == 1 and default_stripes(65536) == 4 and default_stripes(1 << 30) == 16
    for bad in (0, 4, 65):
        with pytest.raises(ValueError, match="stripes"):
            SlotTable(9, stripes=bad)  # 4: ceil(9/4) = 3 slots each leaves the fourth empty
    table = SlotTable(64, seed=0, stripes=4)
    assert (table.stripes, table.stripe_slots) == (4, 16)
    assert table.fd is not None
    with pytest.raises(ValueError, match="not a slot table"):  # the size is right, the stripes are not
        SlotTable(64, SharedMemory(table_nbytes(64, 4), os.dup(table.fd)), stripes=2)
    other = SlotTable(64, SharedMemory(table_nbytes(64, 4), os.dup(table.fd)), stripes=4)
    _fill(other, 3, os.getpid(), 5)
    assert table.stats().full == 5
    other.close()
    table.close()


def test_draws_are_uniform_over_stripes_of_unequal_fill() -> None:
    """Stripe 0 full, stripe 1 a quarter full: a draw picks a stripe in proportion to its full slots, so every full
    slot is drawn as often (picking stripes alike would draw stripe 1's slots four times as often)."""
    table = SlotTable(64, seed=5, stripes=2)
    me = os.getpid()
    _fill(table, 0, me, 32)
    _fill(table, 1, me, 8)
    hits = np.zeros(64, dtype=np.int64)
    draws = 3000
    for _ in range(draws):
        ids, _versions = table.draw_full(me, 4)
        assert len(ids) == 4 and len(np.unique(ids // 32)) == 1  # one stripe per draw
        hits[ids] += 1
        table.release_read(me, ids, evict=False)
    full = np.flatnonzero(table.state == FULL)
    assert len(full) == 40 and hits.sum() == 4 * draws
    share_of_stripe_1 = hits[32:].sum() / hits.sum()
    assert 0.15 < share_of_stripe_1 < 0.25, share_of_stripe_1  # 8 of 40 full slots: 0.2
    expected = 4 * draws / 40
    assert hits[full].min() > 0.7 * expected and hits[full].max() < 1.3 * expected, hits[full]
    _consistent(table)
    table.close()


def test_a_draw_no_stripe_can_serve_is_wide_and_its_release_moves_the_lane_once() -> None:
    table = SlotTable(32, seed=1, stripes=4)
    me = os.getpid()
    for k in range(4):
        _fill(table, k, me, 3)
    ids, versions = table.draw_full(me, 10)  # 12 full, 3 in each stripe: only a draw over stripes has 10
    assert len(ids) == 10 and len(np.unique(ids)) == 10 and len(np.unique(ids // 8)) == 4
    assert (table.state[ids] == READING).all() and (table.version[ids] == versions).all()
    _consistent(table)
    assert table.release_read(me, ids, evict=True, lane=LANE, batches=2) == 10
    assert table.lane_values((LANE,)) == (2,) and int(table.lanes[LANE]) == 2
    _consistent(table)
    assert table.counts()[1] == 10  # rows read, the wide releases' included
    table.close()


def test_lanes_and_counts_sum_over_the_stripes() -> None:
    """A writer's commit of slots in several stripes moves its lane run by run; the lane is the sum over stripes."""
    table = SlotTable(64, seed=2, stripes=4)
    me = os.getpid()
    reserved = np.concatenate([_in_stripe(table, k, me, 3 + k) for k in (2, 0, 3)])
    assert table.commit_written(me, reserved, LANE) == 5 + 3 + 6 == len(reserved)
    assert [int(table._lanes[k, LANE]) for k in range(4)] == [3, 0, 5, 6]
    assert table.lane_values((LANE, LANE + 1)) == (14, 0) and int(table.lanes[LANE]) == 14
    held, fresh = table.commit_and_acquire(me, _in_stripe(table, 1, me, 4), 6, 0, LANE)
    assert held == 4 and len(fresh) == 6 and len(np.unique(fresh // 16)) == 1
    assert table.lane_values((LANE,)) == (18,)
    written, read, stats = table.counts()
    assert (written, read, stats.full, stats.in_flight) == (18, 0, 18, 6)
    _consistent(table)
    table.close()


def test_versions_are_unique_over_the_stripes() -> None:
    table = SlotTable(64, seed=3, stripes=4)
    me = os.getpid()
    for k in (0, 1, 2, 3, 1, 0):
        ids = _fill(table, k, me, 2)
        assert (table.version[ids] % 4 == k).all()  # clock * stripes + k
        table.evict(ids)
    written = table.version[table.version > 0]
    assert len(written) == 12 and len(np.unique(written)) == 12
    table.close()


def test_repair_and_full_ids_cover_every_stripe() -> None:
    table = SlotTable(64, seed=4, stripes=4)
    me = os.getpid()
    for k in range(4):
        _fill(table, k, me, 6)

    def hold_everywhere() -> int:
        child = os.getpid()
        for k in range(4):
            _in_stripe(table, k, child, 2)  # a writer's reservations in every stripe
        table.draw_full(child, 12)  # and a reader's draw: 24 full, 6 a stripe, so a wide one
        return 0

    pid = _fork(hold_everywhere)
    assert _wait(pid) == 0
    assert table.repair() == 8 + 12
    assert not np.isin(table.state, (WRITING, READING)).any()
    _consistent(table)
    full = table.full_ids()
    assert len(full) == 24 and len(np.unique(full // 16)) == 4
    np.testing.assert_array_equal(full, np.flatnonzero(table.state == FULL))
    table.close()


def test_wide_ops_take_the_stripes_in_stripe_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes each holding one lock and waiting for another's deadlock: every op that holds several takes
    them in stripe order (NOTE [ Stripes ]); one-stripe ops hold one at a time."""
    table = SlotTable(64, seed=5, stripes=4)
    me = os.getpid()
    taken: list[int] = []
    held: set[int] = set()
    real_acquire, real_release = NodeLock.acquire, NodeLock.release

    def acquire(lock: NodeLock, wait_s: float | None = None) -> None:
        assert not held or lock.index > max(held), f"stripe {lock.index} taken while holding {sorted(held)}"
        real_acquire(lock, wait_s)
        held.add(lock.index)
        taken.append(lock.index)

    def release(lock: NodeLock) -> None:
        held.discard(lock.index)
        real_release(lock)

    monkeypatch.setattr(NodeLock, "acquire", acquire)
    monkeypatch.setattr(NodeLock, "release", release)
    for k in range(4):
        _fill(table, k, me, 5)
    ids, _ = table.draw_full(me, 18)  # wide
    table.release_and_draw(me, ids, False, 3)
    table.evict(np.arange(0, 64, 5))
    table.stats()
    table.full_ids()
    table.lane_values((LANE,))
    table.repair(scan=True)
    assert not held and taken.count(0) >= 6 and taken.count(3) >= 6
    monkeypatch.undo()
    table.close()


def test_a_wide_op_its_holder_died_in_is_rolled_forward_by_the_next_one_stripe_op() -> None:
    """A repair (wide) killed half-way through applying: the next process to take any one stripe's lock lets go,
    takes every lock in order, rolls the repair forward, and only then makes its own transition."""
    table = SlotTable(64, seed=6, stripes=4)
    me = os.getpid()
    for k in range(4):
        _fill(table, k, me, 4)

    def reader() -> int:
        table.draw_full(os.getpid(), 12)  # a wide draw: 4 full a stripe
        return 0

    assert _wait(_fork(reader)) == 0
    status = repair_killed_in_the_journal(table)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert int(table._wide.header[journal.H_LENGTH]) != 0, "the helper left no wide op journaled"
    assert lock_is_free(table)
    got = _in_stripe(table, 2, me, 2)  # one stripe's op: rolls the repair forward first
    assert len(got) == 2 and int(table._wide.header[journal.H_LENGTH]) == 0
    assert not (table.state == READING).any()
    _consistent(table)
    table.close()


def test_many_processes_on_many_stripes_lose_no_slot() -> None:
    """Writers, readers and wide ops from several processes at once, each with a deadline: every slot ends in
    one state and every stripe's counts match its states."""
    table = SlotTable(256, seed=7, stripes=4)

    def writer() -> int:
        me, held = os.getpid(), np.empty(0, dtype=np.intp)
        for _ in range(300):
            _, held = table.commit_and_acquire(me, held, 7, 0, LANE)
        table.commit_written(me, held, LANE)
        return 0

    def reader() -> int:
        me, held = os.getpid(), np.empty(0, dtype=np.intp)
        for _ in range(300):
            _, held, _versions = table.release_and_draw(me, held, True, 5, 0, LANE + 1, 1)
        table.release_read(me, held, True, LANE + 1, 1)
        return 0

    def wide() -> int:
        for _ in range(100):
            table.stats(wait_s=10.0)
            table.evict(np.arange(0, 256, 31), wait_s=10.0)
            table.full_ids(wait_s=10.0)
        return 0

    pids = [_fork(f) for f in (writer, writer, reader, reader, wide)]
    for pid in pids:
        assert _wait(pid) == 0
    _consistent(table)
    written, read, stats = table.counts()
    assert stats.in_flight == 0 and table.lane_values((LANE,)) == (written,)
    assert read == 5 * table.lane_values((LANE + 1,))[0]
    table.close()
