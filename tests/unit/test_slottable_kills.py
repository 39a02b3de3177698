"""Every line of every slot-table op, cut: SIGKILL there, or an exception there in a process that lives on.

The hypothesis machine (test_slottable_machine.py) draws kill lines at random, so deep lines of rare ops seldom get
one. This test is exhaustive and deterministic instead. For each op it prepares the same table (full slots, a dead
reader's batch with one slot marked by evict(), a dead writer's reservation, empty slots; and what the op itself
needs, held under the victim's pid), forks a victim process and runs the op under a trace function that cuts it
at the k-th line it runs in the slot table's modules, for every k from the first line to past the last:
- ``kill``: SIGKILL just before that line (lock held or not, before or after the journal's commit point, in the
  middle of applying an op, in a roll-forward, in the holder registry);
- ``raise``: KeyboardInterrupt raised from that line in a process that catches it and goes on. Raised only where a
  synchronous exception can arise: not at ``try``/``finally``/``except``/``else`` lines, ``return`` of a constant,
  the release calls themselves or the node lock's bookkeeping (asynchronous exceptions there are what the lock's
  signal deferral is for; test_nodelock.py's SIGINT storm tests it), but inside the lock's attempt (``_take``)
  where os.open or flock can fail.
Afterwards, while the victim still lives (raise), the lock must be free to another process and to the victim
itself; then the table, read under the lock (which rolls forward a journaled op), must equal the table before
the op or after it whole (or after the first of a fused op's two journaled halves): every slot's state, the
holder of every held slot, the version of every full or read slot, the rows written and read, the version clock,
the counts of full and empty slots, the lanes (a commit's or a release's count: NOTE [ Lanes ] in shm/lanes.py);
and the journal must be empty.
"""

from __future__ import annotations

import inspect
import linecache
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from types import FrameType
from typing import Any

import numpy as np
import pytest
from lean import LeanProcess
from slot_audit import lock_is_free, repair_killed_in_the_journal

from gigashuffle.shm import holders, journal, nodelock, picker, readops, slotmap, slottable, stripes, wideops
from gigashuffle.shm.slottable import EMPTY, FULL, READING, SlotTable

SLOTS = 16
LANE = 5  # the lane the commits and releases move (NOTE [ Lanes ] in shm/lanes.py)
WAIT_S = 30.0
_TRACED = frozenset(
    {
        slottable.__file__, slotmap.__file__, journal.__file__, nodelock.__file__, picker.__file__, holders.__file__,
        stripes.__file__, wideops.__file__, readops.__file__,
    }
)  # fmt: skip
_NO_RAISE_TEXT = ("try:", "finally:", "except", "else:")
# The releases of a lock held (each protects its own body with try/finally), as the node lock's own lines are.
_NO_RAISE_CALLS = (
    "self._release()", "self._lock.release()", "with self._locked(", "self._release_all()", "self._release_from(",
    "stripe.release()", "target.release()", "released.release()", "self.lock.release()", "self._stripes[i].release()",
)  # fmt: skip
_CONSTANT_RETURN = re.compile(r"return( (True|False|None|-?\d+))?")


def _lines_of(function: Callable[..., Any]) -> set[int]:
    lines, first = inspect.getsourcelines(function)
    return set(range(first, first + len(lines)))


_LOCK_ATTEMPT = _lines_of(nodelock.NodeLock._take) | _lines_of(nodelock.NodeLock._open_own_description)


def _raisable(filename: str, lineno: int) -> bool:
    text = linecache.getline(filename, lineno).strip()
    if text.startswith(_NO_RAISE_TEXT) or any(call in text for call in _NO_RAISE_CALLS):
        return False
    if _CONSTANT_RETURN.fullmatch(text):  # compiled after the try block is left: a raise there escapes its handlers
        return False
    return filename != nodelock.__file__ or lineno in _LOCK_ATTEMPT


class _Cut:
    """A trace function that kills this process before, or raises from, the ``at``-th line it runs (counting
    only raisable lines for ``raise``); with ``at`` -1 it only counts."""

    def __init__(self, mode: str, at: int) -> None:
        self.mode, self.at = mode, at
        self.lines = self.raisable = 0

    def __call__(self, frame: FrameType, event: str, arg: object) -> Any:
        return self._line if frame.f_code.co_filename in _TRACED else None

    def _line(self, frame: FrameType, event: str, arg: object) -> Any:
        if event != "line":
            return self._line
        if self.mode == "kill" and self.lines == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.lines += 1
        if _raisable(frame.f_code.co_filename, frame.f_lineno):
            if self.mode == "raise" and self.raisable == self.at:
                raise KeyboardInterrupt(f"cut at {frame.f_code.co_name}:{frame.f_lineno}")
            self.raisable += 1
        return self._line


@dataclass(frozen=True)
class Op:
    name: str
    prep: Callable[[SlotTable, int], Any]  # run by the test under the victim's pid before the op; returns args
    run: Callable[[SlotTable, int, Any], object]
    first_half: Callable[[SlotTable, int, Any], object] | None = None  # a fused op's first journaled op


def _reserve(table: SlotTable, v: int) -> Any:
    return table.acquire_empty(v, 3)


def _batch(table: SlotTable, v: int) -> Any:
    ids, versions = table.draw_full(v, 3)
    table.evict(ids[:1], versions[:1])  # one slot of the batch marked: a keeping release empties it
    return ids


def _evict_args(table: SlotTable, v: int) -> Any:
    ids = np.arange(SLOTS)
    kinds = ids % 3  # any write (-1), the current one, a stale one
    versions = np.where(kinds == 0, -1, np.where(kinds == 1, table.version, table.version + 100))
    return ids, versions


def _half_repaired(table: SlotTable, v: int) -> Any:
    """A repair killed half-way through applying its journaled op: the victim's next lock rolls it forward."""
    status = repair_killed_in_the_journal(table)
    assert os.WIFSIGNALED(status), "the helper's repair was not cut"
    assert table._wide.words[journal.H_LENGTH] != 0, "the helper left no journaled op (a repair is wide)"
    return None


OPS = [
    Op("acquire_empty", lambda t, v: None, lambda t, v, a: t.acquire_empty(v, 3)),
    Op("commit_written", _reserve, lambda t, v, a: t.commit_written(v, a, LANE)),
    Op(
        "commit_and_acquire",
        _reserve,
        lambda t, v, a: t.commit_and_acquire(v, a, 2, 0, LANE),
        lambda t, v, a: t.commit_written(v, a, LANE),
    ),
    Op("give_back", _reserve, lambda t, v, a: t.give_back(v, a)),
    Op("draw_full", lambda t, v: None, lambda t, v, a: t.draw_full(v, 3)),
    Op("release_read_keep", _batch, lambda t, v, a: t.release_read(v, a, False, LANE, 1)),
    Op("release_read_evict", _batch, lambda t, v, a: t.release_read(v, a, True, LANE, 1)),
    Op(
        "release_and_draw",
        _batch,
        lambda t, v, a: t.release_and_draw(v, a, False, 3, 0, LANE, 1),
        lambda t, v, a: t.release_read(v, a, False, LANE, 1),
    ),
    Op("evict", _evict_args, lambda t, v, a: t.evict(*a)),
    Op("repair", lambda t, v: None, lambda t, v, a: t.repair()),
    Op("repair_scan", lambda t, v: None, lambda t, v, a: t.repair(scan=True)),
    Op("roll_forward", _half_repaired, lambda t, v, a: t.stats()),
]


# Linux's PID_MAX_LIMIT on 64-bit: /proc/sys/kernel/pid_max is at most this, and every pid is below pid_max.
PID_MAX_LIMIT = 1 << 22


def _dead() -> tuple[int, int]:
    """The pids of the prepared table's dead writer and reader: two that no process can have, so that /proc has no
    process under them, as for a reaped one, for the whole run.

    Pids of forked and reaped children were reused: pid_max is 32768 on the CI machine and the suite starts
    thousands of processes, so the counter wraps every few minutes, and then a victim forked here could get the
    dead reader's pid. Its view counted the dead reader's batch as its own and a cut at line 0 matched no whole
    outcome (two cases of a full run failed so, one after the other)."""
    return PID_MAX_LIMIT, PID_MAX_LIMIT + 1


def _in_stripe(table: SlotTable, k: int, pid: int, n: int) -> Any:
    """``acquire_empty`` in stripe ``k`` (its choice of stripe is random: NOTE [ Stripes ])."""
    table._for_writer = lambda n: table._stripes[k]  # type: ignore[method-assign]
    try:
        return table.acquire_empty(pid, n)
    finally:
        del table._for_writer


def _base(dead: tuple[int, int], stripes: int = 1) -> SlotTable:
    table = SlotTable(SLOTS, seed=0, stripes=stripes)
    me = os.getpid()
    if stripes == 2:  # 5 full in each stripe of 8, a dead reader's batch in one, a dead writer's 2 slots
        for k in (0, 1):
            table.commit_written(me, _in_stripe(table, k, me, 5))
        drawn, versions = table.draw_full(dead[1], 3)
        table.evict(drawn[:1], versions[:1])
        _in_stripe(table, 1, dead[0], 2)
        return table
    table.commit_written(me, table.acquire_empty(me, 10))
    drawn, versions = table.draw_full(dead[1], 3)  # a dead reader's batch, one slot marked by evict()
    table.evict(drawn[:1], versions[:1])
    table.acquire_empty(dead[0], 2)  # a dead writer's reservation
    return table


def _view(table: SlotTable, victim: int) -> tuple[bytes, bytes, bytes, tuple[int, ...]]:
    state = table.state.copy()
    held = (state != EMPTY) & (state != FULL)
    holder = np.where(held, table.holder, 0)
    holder[holder == victim] = -1  # the victim of each run has its own pid
    written = (state == FULL) | (state >= READING)  # a writing slot's version is stamped after its acquire
    version = np.where(written, table.version, 0)
    words = (journal.H_WRITTEN, journal.H_READ, journal.H_CLOCK, journal.H_FULL, journal.H_EMPTY)
    counters = [int(s.header[i]) for s in table._stripes for i in words]
    counters.append(int(table._wide.header[journal.H_READ]))
    lanes = tuple(int(v) for v in table.lanes[: LANE + 2])  # NOTE [ Lanes ]: a lane moves with its op, whole
    return state.tobytes(), holder.tobytes(), version.tobytes(), (*counters, *lanes)


def _victim(conn: Connection, table: SlotTable, op: Op) -> None:
    me = os.getpid()
    args, mode, at, which = conn.recv()
    cut = _Cut(mode, at)
    run = op.run if which == "run" else op.first_half
    assert run is not None
    sys.settrace(cut)
    try:
        run(table, me, args)
        outcome = "done"
    except KeyboardInterrupt as exc:
        outcome = f"raised {exc}"
    finally:
        sys.settrace(None)
    conn.send((outcome, cut.lines, cut.raisable))
    if outcome.startswith("raised"):
        conn.recv()  # the test checks the lock from outside first: this process's own use would unlock it
        try:
            table.stats(wait_s=5.0)  # its thread lock is free too
            conn.send("free")
        except Exception as exc:  # reported to the test, which fails with it
            conn.send(repr(exc))
    conn.recv()  # stay alive until the test is done looking


def _recv(conn: Connection) -> Any:
    """The victim's next message, or None if it died."""
    if not conn.poll(WAIT_S):
        raise AssertionError(f"the victim said nothing within {WAIT_S}s (stuck on the lock?)")
    try:
        return conn.recv()
    except EOFError:
        return None


View = tuple[bytes, bytes, bytes, tuple[int, ...]]


def _trial(
    dead: tuple[int, int], op: Op, mode: str, at: int, which: str = "run", stripes: int = 1
) -> tuple[View, View, Any]:
    """One run of ``op`` in a victim cut at line ``at``: the table before the op, after it, and the victim's reply
    (None if it was killed)."""
    table = _base(dead, stripes)
    parent_end, child_end = Pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            parent_end.close()
            _victim(child_end, table, op)
            code = 0
        except EOFError:  # the test is done looking
            code = 0
        finally:
            os._exit(code)
    child_end.close()
    victim = pid
    try:
        args = op.prep(table, pid)
        before = _view(table, pid)
        parent_end.send((args, mode, at, which))
        reply = _recv(parent_end)
        if reply is None:
            _, status = os.waitpid(pid, 0)
            pid = -1
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"victim exited {status}"
        elif reply[0].startswith("raised"):
            assert lock_is_free(table), f"{op.name}: {reply[0]} left the node lock held"
            parent_end.send("check")
            assert _recv(parent_end) == "free", f"{op.name}: {reply[0]} left the thread lock held"
        with table._locked(wait_s=5.0):  # the next holder rolls forward what the victim journaled
            assert int(table._header[journal.H_LENGTH]) == 0 and int(table._wide.header[journal.H_LENGTH]) == 0
            after = _view(table, victim)
        return before, after, reply
    finally:
        parent_end.close()
        if pid > 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        table.close()


def _split_reserve(table: SlotTable, v: int) -> Any:
    return np.concatenate([_in_stripe(table, 0, v, 2), _in_stripe(table, 1, v, 1)])


def _wide_batch(table: SlotTable, v: int) -> Any:
    ids, _versions = table.draw_full(v, 7)  # no stripe has 7 full: a wide draw
    assert len(np.unique(np.asarray(ids) // table.stripe_slots)) == 2, "the prepared draw is not wide"
    return ids


# With two stripes of 8 slots (NOTE [ Stripes ]): an op of one stripe (which checks the wide journal), a writer's
# commit of slots in both stripes (two ops, in order: the first run alone is a whole outcome too), and a wide draw
# and its releases (one op over both stripes, the lane with it).
STRIPED_OPS = [
    Op(
        "commit_written_two_stripes",
        _split_reserve,
        lambda t, v, a: t.commit_written(v, a, LANE),
        lambda t, v, a: t.commit_written(v, a[:2], LANE),
    ),
    Op("draw_full", lambda t, v: None, lambda t, v, a: t.draw_full(v, 3)),
    Op("draw_wide", lambda t, v: None, lambda t, v, a: t.draw_full(v, 7)),
    Op("release_wide_evict", _wide_batch, lambda t, v, a: t.release_read(v, a, True, LANE, 1)),
    Op("release_wide_keep", _wide_batch, lambda t, v, a: t.release_read(v, a, False, LANE, 1)),
]  # evict and repair are wide ops whatever the stripes: the one-stripe table's cases above cover their journal


# The cuts run in a lean interpreter (tests/lean.py): each of their hundreds of victims is a fork, which costs about
# half as much there as from a pytest worker that imported every test module; the body is the same.
@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_an_op_cut_at_any_line_happens_whole_or_not_at_all(lean: LeanProcess, op: Op) -> None:
    lean.call(__name__, "cut_everywhere", op.name, 1)


@pytest.mark.parametrize("op", STRIPED_OPS, ids=[op.name for op in STRIPED_OPS])
def test_a_striped_op_cut_at_any_line_happens_whole_or_not_at_all(lean: LeanProcess, op: Op) -> None:
    lean.call(__name__, "cut_everywhere", op.name, 2)


def cut_everywhere(name: str, stripes: int) -> None:
    """The op named ``name`` of the table of ``stripes`` stripes, cut at every line (run in the lean process)."""
    ops = {op.name: op for op in (OPS if stripes == 1 else STRIPED_OPS)}
    _cut_everywhere(_dead(), ops[name], stripes)


def _cut_everywhere(dead: tuple[int, int], op: Op, stripes: int) -> None:
    before, after, reply = _trial(dead, op, "kill", -1, stripes=stripes)
    assert reply is not None and reply[0] == "done"
    lines, raisable = reply[1], reply[2]
    assert before != after or op.name == "give_back", f"{op.name} changed nothing: the prepared state is wrong"
    allowed = {"before": before, "after": after}
    if op.first_half is not None:
        allowed["first half"] = _trial(dead, op, "kill", -1, "first", stripes)[1]
    if op.name == "roll_forward":
        allowed = {"rolled forward": after}  # the journaled repair happens whatever the victim does
    for mode, count in (("kill", lines), ("raise", raisable)):
        seen: set[str] = set()
        for at in range(count + 1):
            _, got, reply = _trial(dead, op, mode, at, stripes=stripes)
            names = [name for name, view in allowed.items() if view == got]
            assert names, f"{op.name} cut ({mode}) at line {at} of {count}: the table matches no whole outcome"
            seen.update(names)
            if at == count:
                assert reply is not None and reply[0] == "done", f"{op.name} did not finish past its last line"
        assert seen == set(allowed), f"{op.name} ({mode}): cuts never left {set(allowed) - seen}"
