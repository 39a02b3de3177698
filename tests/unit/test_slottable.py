"""The slot table on its own: transitions, uniform draws, versions, repair after kills, many processes at once.

No Redis and no loader: real shared memory, real ``flock``, real forked processes killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from forked import fork_child as _fork
from forked import wait_child as _wait
from slot_audit import TableSnapshot, lock_is_free, snapshot

from gigashuffle import NodeLockBusy
from gigashuffle.procs.reader import draw_batches as reader_draw
from gigashuffle.shm.buffer import SharedMemory
from gigashuffle.shm.picker import SlotPicker
from gigashuffle.shm.slottable import (
    EMPTY,
    FULL,
    READING,
    READING_EVICT,
    WRITING,
    LockUsage,
    ShuffleBufferStats,
    SlotTable,
    table_nbytes,
)
from gigashuffle.shm.stripes import Stripe

_WAIT_S = 30.0


def _fill(table: SlotTable, pid: int, n: int) -> np.ndarray:
    ids = table.acquire_empty(pid, n)
    assert table.commit_written(pid, ids) == len(ids)
    return ids


def test_write_then_read_cycle() -> None:
    table = SlotTable(16, seed=1)
    assert snapshot(table) == TableSnapshot(empty=16, writing=0, full=0, reading=0)
    ids = table.acquire_empty(100, 10)
    assert len(ids) == 10 and len(set(ids.tolist())) == 10
    assert (table.state[ids] == WRITING).all() and (table.holder[ids] == 100).all()
    assert snapshot(table) == TableSnapshot(6, 10, 0, 0)
    assert len(table.acquire_empty(101, 10)) == 6  # only what is empty
    assert table.commit_written(100, ids) == 10
    assert snapshot(table) == TableSnapshot(0, 6, 10, 0)
    assert len(table.draw_full(200, 4, min_full=11)[0]) == 0  # below the mixing threshold
    got, versions = table.draw_full(200, 4, min_full=10)
    assert len(got) == 4 and set(got.tolist()) <= set(ids.tolist())
    assert (table.version[got] == versions).all()
    assert snapshot(table) == TableSnapshot(0, 6, 6, 4)
    assert table.stats() == ShuffleBufferStats(full=6, empty=0, in_flight=10)
    assert table.release_read(200, got[:2], evict=True) == 2
    assert table.release_read(200, got[2:], evict=False) == 2
    assert snapshot(table) == TableSnapshot(2, 6, 8, 0)
    assert table.stats() == snapshot(table).stats() == ShuffleBufferStats(full=8, empty=2, in_flight=6)
    assert (table.state[got[:2]] == EMPTY).all() and (table.state[got[2:]] == FULL).all()
    assert table.counts()[:2] == (10, 4)  # committed by writers, released by readers


def test_only_the_holder_moves_its_slots() -> None:
    table = SlotTable(8, seed=2)
    ids = table.acquire_empty(1, 4)
    assert table.commit_written(2, ids) == 0  # not pid 2's
    assert table.commit_written(1, ids) == 4
    assert table.commit_written(1, ids) == 0  # already full: a retry commits nothing
    got, _ = table.draw_full(3, 4)
    assert table.release_read(4, got, evict=True) == 0
    assert snapshot(table).reading == 4


def test_a_writer_commits_and_reserves_its_next_slots_in_one_hold_and_gives_back_what_it_did_not_write() -> None:
    table = SlotTable(10, seed=4)
    first = table.acquire_empty(1, 4)
    committed, reserved = table.commit_and_acquire(1, first, 4)
    assert committed == 4 and len(reserved) == 4 and not set(reserved.tolist()) & set(first.tolist())
    assert (table.state[first] == FULL).all() and (table.state[reserved] == WRITING).all()
    assert (table.holder[reserved] == 1).all()
    assert snapshot(table) == TableSnapshot(empty=2, writing=4, full=4, reading=0)
    assert table.counts()[:2] == (4, 0)  # a reservation is not a write
    assert len(table.commit_and_acquire(1, reserved[:1], 5)[1]) == 0  # all or nothing: 2 are empty
    assert len(table.commit_and_acquire(1, reserved[1:2], 2)[1]) == 2
    held, fresh = table.commit_and_acquire(2, reserved[2:], 1)
    assert held == 0 and len(fresh) == 0  # not pid 2's slots, and none is empty
    assert table.give_back(2, reserved[2:]) == 0  # not pid 2's
    assert table.give_back(1, reserved[2:]) == 2
    assert (table.state[reserved[2:]] == EMPTY).all()
    assert snapshot(table) == TableSnapshot(empty=2, writing=2, full=6, reading=0)
    assert table.counts()[:2] == (6, 0)
    assert table.give_back(1, reserved[2:]) == 0  # already empty: a retry gives back nothing


def test_a_reservation_never_keeps_the_buffer_below_the_readers_threshold() -> None:
    # 16 slots: 10 full, pid 1 writing 2, 4 empty. Reserving 4 more would leave 12 + 4 - 4 = 12 slots full or empty.
    table = SlotTable(16, seed=6)
    _fill(table, 9, 10)
    writing = table.acquire_empty(1, 2)
    held, fresh = table.commit_and_acquire(1, writing[:1], 4, min_full=16)  # fill_once: every slot
    assert held == 1 and len(fresh) == 0
    held, fresh = table.commit_and_acquire(1, writing[1:], 4, min_full=12)
    assert held == 1 and len(fresh) == 4 and (table.state[fresh] == WRITING).all()
    assert snapshot(table) == TableSnapshot(empty=0, writing=4, full=12, reading=0)


def test_versions_bump_on_every_write_and_stale_evicts_are_ignored() -> None:
    table = SlotTable(4, seed=3)
    _fill(table, 1, 4)
    first, v1 = table.draw_full(2, 4)
    table.release_read(2, first, evict=True)
    _fill(table, 1, 4)
    again, v2 = table.draw_full(2, 4)
    order1, order2 = np.argsort(first), np.argsort(again)
    assert (v2[order2] > v1[order1]).all()  # each slot was written again, so each has a newer version
    table.release_read(2, again, evict=False)
    assert table.evict(first, v1) == 0  # an INDEX_KEY entry of the earlier write: the newer rows stay
    assert snapshot(table).full == 4
    assert table.evict(again[:2], v2[:2]) == 2
    assert snapshot(table) == TableSnapshot(2, 0, 2, 0)
    assert table.evict(again[:2], v2[:2]) == 0  # already empty
    assert table.evict(again[2:]) == 2  # no versions: any write
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        table.evict([4])


def test_evict_while_reading_takes_effect_at_release() -> None:
    table = SlotTable(4, seed=4)
    _fill(table, 1, 4)
    got, versions = table.draw_full(2, 4)
    assert table.evict(got[:1], versions[:1]) == 1
    assert table.state[got[0]] == READING_EVICT
    # A writer cannot take it while the reader still gathers it.
    assert len(table.acquire_empty(1, 4)) == 0
    table.release_read(2, got, evict=False)
    assert table.state[got[0]] == EMPTY and (table.state[got[1:]] == FULL).all()


@pytest.mark.parametrize("full_slots", [64, 100, 1000])  # scan path (few full) and rejection path (many full)
def test_draws_are_uniform_over_full_slots(full_slots: int) -> None:
    slots, n, rounds = 1000, 16, 3000
    table = SlotTable(slots, seed=5)
    table.acquire_empty(1, slots)
    written = np.random.default_rng(6).choice(slots, full_slots, replace=False).astype(np.int32)
    table.commit_written(1, written)
    counts = np.zeros(slots, dtype=np.int64)
    for _ in range(rounds):
        got, _ = table.draw_full(2, n)
        assert len(np.unique(got)) == n
        counts[got] += 1
        table.release_read(2, got, evict=False)
    assert counts.sum() == n * rounds and set(np.flatnonzero(counts).tolist()) <= set(written.tolist())
    expected = n * rounds / full_slots
    chi2 = float((((counts[written] - expected) ** 2) / expected).sum())
    # Seeded, so deterministic; for a uniform draw chi2 ~ dof = full_slots - 1 with sd sqrt(2 dof). A draw that
    # favoured low ids, or one part of the table, lands far above this bound.
    dof = full_slots - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), chi2


def test_candidates_drawn_before_the_lock_stay_uniform_when_the_table_changed_meanwhile() -> None:
    """A reader draws its candidate ids before it takes the node lock, sized from a count of full slots read
    without it; by the time it holds the lock, half of those slots may have been read. The draw then tops the
    candidates up under the lock and stays a uniform sample of the slots full at that moment."""
    slots, n, rounds = 1000, 64, 2000
    picker = SlotPicker(slots, seed=9)
    state = np.full(slots, EMPTY, dtype=np.uint8)
    full = np.random.default_rng(10).choice(slots, slots // 2, replace=False)
    state[full] = FULL
    counts = np.zeros(slots, dtype=np.int64)
    for _ in range(rounds):
        candidates = picker.candidates(n, slots)  # sized as if every slot were still full
        got = picker.sample_full(state, n, len(full), candidates)
        assert len(got) == n and len(np.unique(got)) == n and (state[got] == FULL).all()
        counts[got] += 1
    expected = n * rounds / len(full)
    chi2 = float((((counts[full] - expected) ** 2) / expected).sum())
    dof = len(full) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), chi2
    assert len(picker.candidates(n, slots // 8)) == 0  # so few full that the draw lists them instead
    assert len(picker.candidates(n, slots // 2, min_full=slots // 2 + 1)) == 0  # too few to draw at all: a poll
    assert len(picker.candidates(n, slots // 2, min_full=slots // 2)) > n


@pytest.mark.parametrize("claimed", [200, 900])  # the scan path (under a quarter full) and the rejection path
def test_a_draw_with_a_drifted_count_of_full_slots_raises_instead_of_spinning(claimed: int) -> None:
    """The header's count of full slots sizes every draw. Were it ever above the slots really full (a transition
    on slots its process did not hold), rejection sampling could never find n of them: the draw must end with an
    error naming the counts, which kills the reader and reaches the trainer as WorkerDied, never a hang."""
    slots, n = 1000, 64
    picker = SlotPicker(slots, seed=11)
    state = np.full(slots, EMPTY, dtype=np.uint8)
    state[:40] = FULL  # fewer than the 64 asked for
    with pytest.raises(AssertionError, match=rf"counts {claimed} full slots but 40 are full, fewer than the 64"):
        picker.sample_full(state, n, claimed, picker.candidates(n, claimed))
    state[:100] = FULL  # enough, though far fewer than counted: still a uniform draw of the full ones
    got = picker.sample_full(state, n, claimed, picker.candidates(n, claimed))
    assert len(np.unique(got)) == n and (state[got] == FULL).all()


def test_attach_maps_the_same_table() -> None:
    table = SlotTable(8, seed=7)
    ids = _fill(table, 1, 3)
    if table.fd is None:
        raise AssertionError("no fd")
    other = SlotTable(8, SharedMemory(table_nbytes(8), os.dup(table.fd)))
    assert snapshot(other) == TableSnapshot(5, 0, 3, 0)
    assert (other.version[ids] == table.version[ids]).all()
    wrong = SharedMemory(table_nbytes(4), os.dup(table.fd))
    with pytest.raises(ValueError, match="not a slot table of 4 slots"):
        SlotTable(4, wrong)
    wrong.close()
    other.close()
    table.close()


def test_lock_usage_totals_every_hold_of_every_process_that_maps_the_table() -> None:
    """The header counts the node lock's holds and their time across processes (NOTE [ Node lock budget ])."""
    table = SlotTable(16, seed=3)
    assert table.lock_usage() == LockUsage(0.0, 0)
    _fill(table, 1, 8)  # three holds: registering the writer (NOTE [ Stripes ]: under every lock), acquire, commit

    def read_in_child() -> int:
        me = os.getpid()
        ids, _versions = table.draw_full(me, 4)
        return 0 if table.release_read(me, ids, evict=True) == 4 else 1

    assert _wait(_fork(read_in_child)) == 0  # three more: registering the reader, draw, release
    after = table.lock_usage()
    assert after.holds == 6, after
    assert after.held_s > 0.0, after
    with table._locked():  # a hold that lasts at least 50 ms is counted as at least that long
        time.sleep(0.05)
    longer = table.lock_usage()
    assert longer.holds == 7 and longer.held_s - after.held_s >= 0.05, (after, longer)
    table.close()


def test_repair_returns_dead_holders_slots() -> None:
    table = SlotTable(12, seed=8)
    _fill(table, os.getpid(), 8)

    def hold_and_die() -> int:
        table.acquire_empty(os.getpid(), 2)  # a writer mid-copy
        table.draw_full(os.getpid(), 3)  # a reader mid-gather
        os.kill(os.getpid(), signal.SIGKILL)
        return 1

    pid = _fork(hold_and_die)
    assert os.WTERMSIG(_wait(pid)) == signal.SIGKILL
    assert snapshot(table) == TableSnapshot(2, 2, 5, 3)
    assert table.repair() == 5  # pid_alive finds it gone
    assert snapshot(table) == TableSnapshot(4, 0, 8, 0)
    assert table.repair() == 0


def test_repair_of_known_dead_pids_and_evicted_reads() -> None:
    table = SlotTable(6, seed=9)
    _fill(table, 1, 6)
    got, versions = table.draw_full(424242, 4)
    table.evict(got[:1], versions[:1])
    assert table.repair() == 4
    assert table.state[got[0]] == EMPTY and (table.state[got[1:]] == FULL).all()


@pytest.mark.parametrize("applied", ["none", "half", "all"])
def test_kill_inside_a_transition_with_the_lock_held(applied: str) -> None:
    """A child takes the lock, journals a release of its batch, applies part of it and SIGKILLs itself."""
    table = SlotTable(10, seed=10)
    _fill(table, 1, 10)

    def die_in_transition() -> int:
        me = os.getpid()
        got, _ = table.draw_full(me, 6)
        with table._locked():
            from gigashuffle.shm import journal

            table._header[3:5] = (journal.OP_RELEASE_EVICT, me)
            table._header[journal.H_JFULL] = 4  # an evicting release leaves the 4 full slots as they are
            table._header[journal.H_JEMPTY] = 6  # and empties the 6 it held
            table._journal.ids[: len(got)] = got
            if applied != "none":
                table._header[2] = len(got)  # the commit point
                part = got[:3] if applied == "half" else got
                table._journal.apply(journal.OP_RELEASE_EVICT, me, part)
            os.kill(me, signal.SIGKILL)
        return 1

    pid = _fork(die_in_transition)
    assert os.WTERMSIG(_wait(pid)) == signal.SIGKILL
    assert lock_is_free(table)  # the kernel let go of the dead holder's lock
    snap = snapshot(table)  # the first lock holder rolls the journal forward
    if applied == "none":
        assert snap == TableSnapshot(0, 0, 4, 6)  # nothing happened; the reader's slots await repair
        assert table.repair() == 6
        assert snapshot(table) == TableSnapshot(0, 0, 10, 0)
    else:
        assert snap == TableSnapshot(6, 0, 4, 0)  # the whole release happened, exactly once
        assert table.repair() == 0
    assert table._header[2] == 0


def test_kill_inside_a_commit_rolls_forward_keeping_the_versions_stamped_at_acquire() -> None:
    table = SlotTable(8, seed=11)

    def die_in_commit() -> int:
        from gigashuffle.shm import journal

        me = os.getpid()
        ids = table.acquire_empty(me, 8)  # allots versions 1..8, stamped on the slots after the lock is released
        with table._locked():
            table._journal.ids[:8] = ids
            table._header[3:5] = (journal.OP_COMMIT, me)
            table._header[journal.H_JCOUNT] = 8  # rows written once the commit is applied
            table._header[journal.H_JFULL] = 8  # and full slots
            table._header[journal.H_JEMPTY] = 0  # none empty, as the acquire left it
            table._header[2] = 8
            table._journal.apply(journal.OP_COMMIT, me, ids[:5])  # which sets it; the roll-forward again
            os.kill(me, signal.SIGKILL)
        return 1

    assert os.WTERMSIG(_wait(_fork(die_in_commit))) == signal.SIGKILL
    assert snapshot(table) == TableSnapshot(0, 0, 8, 0)
    assert sorted(table.version.tolist()) == list(range(1, 9))
    assert table.counts()[:2] == (8, 0)  # counted once, though applied twice
    ids = table.acquire_empty(1, 0)
    assert len(ids) == 0
    got, _ = table.draw_full(1, 8)
    table.release_read(1, got, evict=True)
    _fill(table, 1, 8)
    assert table.version.min() > 8  # the clock moved past the rolled-forward versions


def test_kill_inside_an_acquire_moves_the_version_clock_once() -> None:
    """The acquire journals the clock's new value: rolled forward after a kill half-way through applying it, the
    clock moves past the dead writer's allotment once, and later writes never get a version twice."""
    table = SlotTable(8, seed=12)

    def die_in_acquire() -> int:
        from gigashuffle.shm import journal

        me = os.getpid()
        ids = np.arange(4, dtype=np.intp)
        with table._locked():
            table._register(me)  # as the acquire does, before its journal
            table._journal.ids[:4] = ids
            table._header[3:5] = (journal.OP_ACQUIRE, me)
            table._header[journal.H_JCOUNT] = 4  # the clock once versions 1..4 are allotted
            table._header[journal.H_JFULL] = 0
            table._header[journal.H_JEMPTY] = 4
            table._header[2] = 4  # the commit point
            table._journal.apply(journal.OP_ACQUIRE, me, ids[:2])  # sets the clock; the roll-forward sets it again
            os.kill(me, signal.SIGKILL)
        return 1

    dead = _fork(die_in_acquire)
    assert os.WTERMSIG(_wait(dead)) == signal.SIGKILL
    assert snapshot(table) == TableSnapshot(4, 4, 0, 0)  # the whole acquire happened: 4 slots writing
    assert (table.holder[:4] == dead).all()
    assert table.repair() == 4  # the dead writer never stamped or wrote them: back to empty
    _fill(table, 1, 8)
    assert sorted(table.version.tolist()) == list(range(5, 13))  # 1..4 went to the dead writer, never again


def test_acquire_finds_scattered_empty_slots_in_order_from_its_cursor_and_wraps() -> None:
    # Empty slots scattered over a table about half full (readers emptied them at random): each acquire returns
    # exactly the next n empty slots after where the last one stopped, wrapping past the end, and finds every
    # empty slot when asked for more than there are.
    slots = 4096
    table = SlotTable(slots, seed=3)
    _fill(table, 1, slots)
    rng = np.random.default_rng(5)
    emptied = np.sort(rng.choice(slots, slots // 2, replace=False)).astype(np.int32)
    table.evict(emptied)
    first = table.acquire_empty(2, 700)
    np.testing.assert_array_equal(first, emptied[:700])
    second = table.acquire_empty(2, 700)
    np.testing.assert_array_equal(second, emptied[700:1400])
    rest = table.acquire_empty(2, slots)  # more than is empty: the remaining ones, then those before the cursor
    np.testing.assert_array_equal(rest, emptied[1400:])
    assert table.commit_written(2, np.concatenate([first, second, rest])) == slots // 2
    table.evict(emptied[:10])
    np.testing.assert_array_equal(table.acquire_empty(2, 50), emptied[:10])  # wrapped around to the start


def test_a_search_for_empty_slots_made_before_the_lock_runs_again_under_it_if_another_writer_took_one() -> None:
    """A writer searches for its empty slots before it takes the node lock (NOTE [ Node lock budget ]); another
    writer may take some of them in between. Under the lock the search is checked and, finding a slot no longer
    empty, made again from the same cursor: the writer gets as many slots as before, none of the other's."""
    slots = 64
    table = SlotTable(slots, seed=3)
    if table.fd is None:
        raise AssertionError("no fd")
    other = SlotTable(slots, SharedMemory(table_nbytes(slots), os.dup(table.fd)))
    real_take = table._take  # a one-stripe op's lock (NOTE [ Stripes ])

    def racing(stripe: Stripe, wait_s: float | None = None) -> None:  # the other's acquire: between search and lock
        table._take = real_take  # type: ignore[method-assign]
        other.acquire_empty(2, 8)
        real_take(stripe, wait_s)

    table._take = racing  # type: ignore[method-assign]
    got = table.acquire_empty(1, 8)
    np.testing.assert_array_equal(got, np.arange(8, 16))  # the first 8 went to the other writer meanwhile
    assert (table.holder[got] == 1).all() and (table.state[got] == WRITING).all()
    assert snapshot(table) == TableSnapshot(48, 16, 0, 0)
    table._take = racing  # type: ignore[method-assign]
    held, fresh = table.commit_and_acquire(1, got, 8)  # all or nothing, still 8, none of the other's
    assert held == 8
    np.testing.assert_array_equal(fresh, np.arange(24, 32))
    assert (table.holder[16:24] == 2).all() and (table.state[fresh] == WRITING).all()
    assert snapshot(table) == TableSnapshot(32, 24, 8, 0)
    other.close()
    table.close()


def test_candidates_kept_where_full_before_the_lock_give_a_uniform_draw_of_the_slots_still_full() -> None:
    """A reader keeps only the candidates that are full before it takes the lock; meanwhile another reader may
    draw some of them and a writer commit others. The draw takes only slots full now, n distinct ones (a slot
    committed in between only through a top-up round), and every slot full at both moments equally often."""
    slots, n, rounds = 1000, 64, 2000
    picker = SlotPicker(slots, seed=12)
    rng = np.random.default_rng(13)
    base = np.full(slots, EMPTY, dtype=np.uint8)
    full = rng.choice(slots, slots // 2, replace=False)
    base[full] = FULL
    empty = np.flatnonzero(base == EMPTY)
    counts = np.zeros(slots, dtype=np.int64)
    fresh = 0  # drawn slots that were committed between the candidates' check and the draw
    for _ in range(rounds):
        state = base.copy()
        candidates = picker.candidates(n, len(full), state=state)
        assert (state[candidates] == FULL).all()
        state[rng.choice(full, 32, replace=False)] = READING  # another reader's draw
        committed = rng.choice(empty, 32, replace=False)
        state[committed] = FULL  # a writer's commit
        got = picker.sample_full(state, n, len(full), candidates)
        assert len(got) == n and len(np.unique(got)) == n and (state[got] == FULL).all()
        fresh += int(np.isin(got, committed).sum())
        counts[got] += 1
    assert fresh < 0.01 * n * rounds  # 32 of 500 full slots, but drawn only when the candidates fell short
    expected = counts[full].sum() / len(full)
    chi2 = float((((counts[full] - expected) ** 2) / expected).sum())
    dof = len(full) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), chi2


def _hammer(table: SlotTable, seed: int, rounds: int, log_fd: int, started_fd: int = -1) -> int:
    """A child that writes and reads at random; exits 3 if it ever finds a slot it holds held by someone else."""
    me = os.getpid()
    rng = np.random.default_rng(seed)
    for i in range(rounds):
        if i == 20 and started_fd >= 0:
            os.write(started_fd, b"!")
        ids = table.acquire_empty(me, int(rng.integers(1, 6)))
        if not ((table.holder[ids] == me) & (table.state[ids] == WRITING)).all():
            return 3
        if table.commit_written(me, ids) != len(ids):
            return 3
        got, versions = table.draw_full(me, int(rng.integers(1, 4)), min_full=4)
        if not ((table.holder[got] == me) & np.isin(table.state[got], (READING, READING_EVICT))).all():
            return 3
        if len(got):
            os.write(log_fd, np.stack([got.astype(np.int64), versions]).T.tobytes())
        if rng.random() < 0.2:  # an evict() racing the readers, with right and stale versions alike
            table.evict(rng.integers(0, table.slots, 2), rng.integers(0, 50, 2))
        if table.release_read(me, got, evict=True) != len(got):
            return 3
    return 0


def test_many_processes_every_slot_accounted_and_no_row_read_twice() -> None:
    table = SlotTable(64, seed=12)
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    workers = [_fork(lambda s=s: _hammer(table, s, 300, write_end)) for s in range(4)]
    started_r, started_w = os.pipe()
    victim = _fork(lambda: _hammer(table, 99, 10**9, write_end, started_w))
    os.close(started_w)
    os.set_blocking(started_r, True)
    assert os.read(started_r, 1) == b"!"  # the victim is mid-run; where exactly the kill lands is up to chance
    os.close(started_r)
    os.kill(victim, signal.SIGKILL)
    os.close(write_end)
    chunks = []
    statuses = []
    pending = [*workers, victim]
    deadline = time.monotonic() + _WAIT_S
    while pending and time.monotonic() < deadline:
        try:
            chunk = os.read(read_end, 1 << 16)
            if chunk:
                chunks.append(chunk)
        except BlockingIOError:
            time.sleep(0.005)
        for pid in list(pending):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses.append((pid, status))
                pending.remove(pid)
    assert not pending, "hammering children did not finish in time"
    os.set_blocking(read_end, True)
    while chunk := os.read(read_end, 1 << 16):  # every writer end is closed now: this ends at EOF
        chunks.append(chunk)
    os.close(read_end)
    assert [os.WEXITSTATUS(s) for p, s in statuses if p != victim] == [0, 0, 0, 0]
    table.repair()
    snap = snapshot(table)
    assert snap.writing == 0 and snap.reading == 0 and snap.empty + snap.full == 64
    reads = np.frombuffer(b"".join(chunks), dtype=np.int64).reshape(-1, 2)
    pairs = {(int(i), int(v)) for i, v in reads}
    assert len(pairs) == len(reads) > 0  # every (slot, version) -- one written row -- was read at most once


def test_a_reader_draws_several_batches_per_hold_and_one_when_too_few_are_full() -> None:
    table = SlotTable(64, seed=4)
    _fill(table, 1, 12)
    me = os.getpid()
    got = reader_draw(table, me, bs=8, batches=2, min_full=0)
    assert got is not None and len(got[0]) == 8  # 12 full: one batch, not nothing
    assert table.release_read(me, got[0], evict=True) == 8
    assert reader_draw(table, me, bs=8, batches=2, min_full=0) is None  # 4 full: not even one batch
    _fill(table, 1, 40)
    got = reader_draw(table, me, bs=8, batches=3, min_full=0)
    assert got is not None and len(got[0]) == 24 and len(set(got[0].tolist())) == 24
    assert (table.state[got[0]] == READING).all()
    np.testing.assert_array_equal(table.version[got[0]], got[1])


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG | os.WUNTRACED)
        if done:
            assert os.WIFSTOPPED(status), f"child {pid} ended (status {status}) instead of stopping"
            return
        time.sleep(0.01)
    raise AssertionError(f"child {pid} did not stop within {_WAIT_S}s")


def test_a_stopped_lock_holder_is_named_counts_never_wait_and_its_death_frees_the_lock() -> None:
    table = SlotTable(64, seed=8)
    _fill(table, 100, 40)
    drawn, _ = table.draw_full(200, 8)
    assert table.lock_holder() is None

    def hold_and_stop() -> int:
        table._acquire()
        os.kill(os.getpid(), signal.SIGSTOP)
        return 0

    pid = _fork(hold_and_stop)
    try:
        _wait_stopped(pid)
        assert table.lock_holder() == pid
        written, read, stats = table.counts()  # the header, read without the lock
        assert (written, read) == (40, 0)
        assert (stats.full, stats.empty, stats.in_flight) == (32, 24, 8)
        for call in (lambda: snapshot(table, wait_s=0.2), lambda: table.repair(wait_s=0.2)):
            with pytest.raises(NodeLockBusy, match=rf"pid {pid} .*stopped by a signal: send it SIGCONT") as raised:
                call()
            assert raised.value.waited_s == 0.2
    finally:
        os.kill(pid, signal.SIGKILL)
        _wait(pid)
    assert table.lock_holder() is None  # the kernel dropped a dead holder's lock
    assert snapshot(table, wait_s=5.0) == TableSnapshot(24, 0, 32, 8)
    assert table.release_read(200, drawn, evict=True) == 8
    assert table.counts()[:2] == (40, 8)
