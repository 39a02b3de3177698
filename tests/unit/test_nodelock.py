"""The node lock against Ctrl-C, exceptions, fork and pid reuse (NOTE [ The node lock under signals and fork ] in
shm/nodelock.py, NOTE [ Holder registry ] in shm/holders.py).

Every test runs the process under test as a real forked child and checks the lock from a fresh open file
description in the test process (``lock_is_free``), which is what any other process of the node would see.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback

import numpy as np
import pytest
from forked import fork_child as _fork
from forked import wait_child as _wait
from slot_audit import TableSnapshot, lock_is_free, snapshot

from gigashuffle.errors import AttachError
from gigashuffle.host.pids import process_start
from gigashuffle.shm import journal
from gigashuffle.shm.buffer import SharedMemory
from gigashuffle.shm.slottable import EMPTY, WRITING, SlotTable, table_nbytes

_WAIT_S = 30.0
STORM_SIGNALS = 1500  # bounded: the storm ends after this many SIGINTs or STORM_S seconds
STORM_S = 6.0


def _read_line(fd: int, wait_s: float = _WAIT_S) -> str:
    """One line the child writes to a pipe, within a deadline."""
    got = b""
    deadline = time.monotonic() + wait_s
    while not got.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"no word from the child within {wait_s}s (read so far: {got!r})")
        chunk = os.read(fd, 256)
        if not chunk:
            raise AssertionError(f"the child closed its pipe after {got!r}")
        got += chunk
    return got.decode().strip()


def _sleep(seconds: float) -> int:
    time.sleep(seconds)
    return 0


def _free_within(table: SlotTable, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while not lock_is_free(table):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _audit(table: SlotTable) -> None:
    """The header's counts against the states, and an empty journal, under the lock."""
    with table._locked(wait_s=5.0):
        counts = np.bincount(table.state, minlength=5)
        assert all(int(s.header[journal.H_LENGTH]) == 0 for s in table._stripes)
        assert int(table._wide.header[journal.H_LENGTH]) == 0
        stats = table.counts()[2]  # the stripes' counts, summed (NOTE [ Stripes ])
        assert stats.full == counts[2] and stats.empty == counts[0], counts


# -- Ctrl-C and exceptions ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stripes", [1, 4])
def test_a_sigint_storm_in_a_process_that_goes_on_never_leaves_the_lock_held(stripes: int) -> None:
    """A thread sends SIGINT every ~2 ms to a process calling stats(wait_s=1), evict(), a transition and repair()
    in a loop, catching KeyboardInterrupt and going on (a notebook, a script that saves a checkpoint on Ctrl-C).
    Afterwards the process itself takes the lock at once, and so does another process while it lives on. With
    stripes, stats, evict and repair take every stripe's lock and the transitions one (NOTE [ Stripes ])."""
    table = SlotTable(4096, seed=1, stripes=stripes)
    ready_r, ready_w = os.pipe()

    def storm() -> int:
        me, counts = os.getpid(), {"interrupts": 0, "calls": 0}
        # A plain flag, not an Event: Event.set() takes a lock in a with-statement, and a SIGINT landing right after
        # its __enter__ leaves that lock held (CPython does not guarantee __exit__ there), so the sender's next wait
        # blocked forever and the child went silent (seen once in a fresh-clone run: no word within 66 s).
        stop, go = [False], [False]

        def sender() -> None:
            # It waits for the main thread's word that start() has returned: a SIGINT inside start()'s own wait for
            # this thread would end the child outside any try (seen once in CI: no word within 66 s).
            while not go[0]:
                time.sleep(0.001)
            for _ in range(STORM_SIGNALS):
                time.sleep(0.002)
                if stop[0]:
                    break
                os.kill(me, signal.SIGINT)
            done.set()  # this thread gets no SIGINT (only the main thread does): its lock is safe

        def calls() -> None:
            # No join, lock or condition wait in this thread: an interrupt inside one of those can leave it in a
            # state the test would then wait on (threading's own trouble, not the node lock's). Flags and polls.
            deadline = time.monotonic() + STORM_S
            while not done.is_set() and time.monotonic() < deadline:
                try:
                    table.stats(wait_s=1.0)
                    table.evict(np.arange(0, 4096, 97), wait_s=1.0)
                    table.commit_written(me, table.acquire_empty(me, 64))
                    table.repair(wait_s=1.0, scan=True)
                    counts["calls"] += 1
                except KeyboardInterrupt:
                    counts["interrupts"] += 1
            stop[0] = True
            while not done.is_set():
                time.sleep(0.005)
            time.sleep(0.05)  # a KeyboardInterrupt may still be on its way

        done = threading.Event()
        threading.Thread(target=sender, daemon=True).start()
        go[0] = True
        for _ in range(STORM_SIGNALS + 1):
            # An interrupt may also land on the test's own lines outside any try (a loop's jump): go on.
            try:
                calls()
                break
            except KeyboardInterrupt:
                counts["interrupts"] += 1
        for _ in range(100):  # this process's thread lock is free too; a last SIGINT may still land here
            try:
                table.stats(wait_s=2.0)
                break
            except KeyboardInterrupt:
                counts["interrupts"] += 1
        os.write(ready_w, f"{counts['interrupts']} {counts['calls']}\n".encode())
        time.sleep(60)  # live on, idle, as a notebook does
        return 0

    def reporting_storm() -> int:
        try:
            return storm()
        except BaseException as error:  # the child's fate goes to the test, not to a silent exit
            where = traceback.extract_tb(error.__traceback__)[-1]
            os.write(ready_w, f"error {error!r} at {where.filename}:{where.lineno}\n".encode())
            raise

    pid = _fork(reporting_storm)
    try:
        # A generous deadline: a loaded machine runs the storm slowly.
        word = _read_line(ready_r, STORM_S + 60)
        assert not word.startswith("error"), f"the storming child failed: {word}"
        interrupts, calls = map(int, word.split())
        assert interrupts > 20, f"the storm hardly interrupted anything ({interrupts} interrupts, {calls} rounds)"
        assert _free_within(table, 5.0), f"the lock is held by {table.lock_holder()} after {interrupts} interrupts"
        _audit(table)
    finally:
        os.kill(pid, signal.SIGKILL)
        _wait(pid)
        os.close(ready_r)
        os.close(ready_w)


def test_an_exception_in_the_release_statistics_does_not_keep_the_lock() -> None:
    table = SlotTable(8, seed=2)
    header = table._header
    header.flags.writeable = False  # the statistics stores in _release raise ValueError
    with pytest.raises(ValueError, match="read-only"):
        table.stats(wait_s=1.0)
    header.flags.writeable = True
    assert lock_is_free(table)
    assert table.stats(wait_s=1.0).empty == 8  # the thread lock is free as well


def test_ctrl_c_ends_a_wait_for_a_lock_held_elsewhere_and_leaves_nothing_held() -> None:
    """An untimed wait (blocking in flock with SIGINT let through) and a timed one both end on Ctrl-C."""
    table = SlotTable(8, seed=3)
    held_r, held_w = os.pipe()

    def hold() -> int:
        table._lock.acquire()
        os.write(held_w, b"held\n")
        time.sleep(60)
        return 0

    holder = _fork(hold)
    try:
        assert _read_line(held_r) == "held"
        for wait_s in (None, 30.0):
            timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            started = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                table._lock.acquire(wait_s)
            timer.join()
            assert time.monotonic() - started < 10.0
        assert table._lock._thread_lock.acquire(blocking=False)
        table._lock._thread_lock.release()
    finally:
        os.kill(holder, signal.SIGKILL)
        _wait(holder)
        os.close(held_r)
        os.close(held_w)
    assert _free_within(table, 5.0)


# -- fork ------------------------------------------------------------------------------------------------------------
def test_a_dead_holders_forked_helper_does_not_keep_its_lock() -> None:
    """A holder forked a helper (a dataset using multiprocessing) after opening its lock description, took the lock
    and was SIGKILLed: the lock is free at once, not when the helper exits, and lock_holder() names no dead pid."""
    table = SlotTable(8, seed=4)
    pipe_r, pipe_w = os.pipe()
    helper_s = 60.0

    def holder() -> int:
        table.stats()  # opens this process's lock description
        helper = _fork(lambda: _sleep(helper_s))
        table._lock.acquire()
        os.write(pipe_w, f"{helper}\n".encode())
        time.sleep(helper_s)
        return 0

    pid = _fork(holder)
    helper = -1
    try:
        helper = int(_read_line(pipe_r))
        assert table.lock_holder() == pid
        os.kill(pid, signal.SIGKILL)
        assert os.WTERMSIG(_wait(pid)) == signal.SIGKILL
        assert _free_within(table, 5.0), f"the helper {helper} keeps the dead holder's lock"
        assert table.lock_holder() is None
        assert process_start(helper) != 0, "the helper should still be alive for this test to mean anything"
    finally:
        if helper > 0:
            os.kill(helper, signal.SIGKILL)  # reparented to init (or a subreaper), which reaps it
        os.close(pipe_r)
        os.close(pipe_w)


# -- holder identity -------------------------------------------------------------------------------------------------
def _sleeper() -> int:
    return _fork(lambda: _sleep(60.0))


def test_repair_naming_a_reused_pid_leaves_the_live_process_its_slots() -> None:
    """The supervisor saw a child reaped; before its repair runs, a new process got that pid and took slots: they
    stay its own (the registry knows the new process by its start time)."""
    table = SlotTable(8, seed=5)
    live = _sleeper()  # stands for the process that now has the reaped child's pid
    try:
        ids = table.acquire_empty(live, 3)  # registered with its own start time
        assert table.repair() == 0
        assert (table.state[ids] == WRITING).all() and (table.holder[ids] == live).all()
    finally:
        os.kill(live, signal.SIGKILL)
        _wait(live)
    assert table.repair() == 3  # now it is gone
    assert snapshot(table) == TableSnapshot(8, 0, 0, 0)


def test_a_new_process_with_a_dead_ones_pid_returns_the_dead_ones_slots_first() -> None:
    table = SlotTable(8, seed=6)
    me = os.getpid()
    old = table.acquire_empty(me, 3)
    # Make the row name an earlier process with this pid (another start time): those slots are the dead one's.
    # This process now plays the new one, which has not registered yet.
    row, start = table._holders.lookup(me)
    table._holders.rows[row, 1] = start - 1
    table._holders.known.discard(me)
    assert table.repair() == 3  # the periodic repair sees the start time differ
    assert (table.state[old] == EMPTY).all()
    again = table.acquire_empty(me, 2)
    assert table.repair() == 0 and table.repair(scan=True) == 0  # the new one's own slots survive repairs
    row, start = table._holders.lookup(me)
    table._holders.rows[row, 1] = start - 1
    table._holders.known.discard(me)
    fresh = table.acquire_empty(me, 1)  # registering over the stale row returns what it held first
    assert (table.state[again] == EMPTY).all() and (table.state[fresh] == WRITING).all()
    assert table.repair() == 0 and table.repair(scan=True) == 0
    assert snapshot(table) == TableSnapshot(7, 1, 0, 0)


def test_a_table_from_another_pid_namespace_is_refused_at_attach() -> None:
    table = SlotTable(8, seed=7)
    table._header[journal.H_PIDNS] += 1  # as if created in another container's pid namespace
    if table.fd is None:
        raise AssertionError("no fd")
    memory = SharedMemory(table_nbytes(8), os.dup(table.fd))
    with pytest.raises(AttachError, match="pid namespace"):
        SlotTable(8, memory)
    memory.close()
    table.close()


_EXIT_SCRIPT = """
import weakref
from gigashuffle.shm.slottable import SlotTable
class Owner: pass
owner = Owner()
table = SlotTable(8, seed=0)
weakref.finalize(owner, lambda: print("repaired at exit:", table.repair(scan=True)))  # as a loader's shutdown
table.stats()  # opens the lock description after: its fd's finalizer is the newer one
"""


def test_the_lock_still_works_in_finalizers_at_exit() -> None:
    """A script that exits without close(): its loader's finalizer repairs the table at exit, after weakref's exit
    hook has run the newer finalizers (the lock fd's must not be among them)."""
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "repaired at exit: 0" in done.stdout, done.stderr
    assert "Bad file descriptor" not in done.stderr and "Traceback" not in done.stderr, done.stderr
