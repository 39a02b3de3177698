"""A hypothesis state machine over the slot table, driven by real forked processes that die at random lines.

Four actors (two writers, two readers) are processes forked from the test. Each serves commands over a pipe and
calls the one ``SlotTable`` the test created before forking (each child opens its own lock description on first
use, as the node lock does after a fork). Beside the table lies a shared array of rows: a writer stores a unique
token in each slot's row before ``commit_written``; a reader reads the rows of the slots it drew.

A step is a *round*: any subset of the actors runs one command each, all at once, so they really contend for the
node lock. Writers acquire empty slots or write and commit the ones they hold; readers draw a batch or release the
one they hold (with or without eviction); any actor may run ``repair()`` instead, as trainers do periodically. Up
to two of them run their command under a trace function that counts the lines executed in the slot table's
modules (shm/slottable.py, journal.py, shm/nodelock.py, picker.py) and
SIGKILLs the process at line ``k`` (drawn by hypothesis): a kill anywhere in the transition -- before the lock,
with it held before or after the journal's commit point, half-way through applying the op, after the unlock, or
while rolling forward the op another victim left half-done -- without the test repeating the implementation's
steps. If the op finishes first it completes normally. Other steps: the parent SIGKILLs an idle actor that holds
slots; calls ``evict(ids, versions)`` with current, stale, wildcard and unknown versions; or calls ``repair()`` as
the supervisor does, which must return exactly the slots of the dead holders.

After a death the parent acts as the supervisor: it reaps the child, takes the lock once (as any next lock holder
would, finishing a journaled op the dead one began), settles what the dead actor's last op did from what the
table still holds under its pid (``_settle``: each op happened whole or not at all) and forks a replacement. It
then repairs at once (the registry finds the reaped pids gone), or leaves the dead pid's slots held while the
others carry on, for a later repair by the supervisor or by an actor (possibly killed in it, too).

The model follows each committed token: delivered (a reader released the batch with eviction, or an evict()
mark, and announced it; never twice), dropped (its reader died after the evicting release took effect, before it
could announce), evicted (by ``evict()``), or still in the table; and what each live or dead actor holds. After
every step the whole table must equal the model: state, holder and version of every slot, the token in every full or
read slot's row, the snapshot counts, the header's totals of rows written and read and its version clock, an empty
journal and a free lock; and every committed token must be in exactly one of those places.
"""

from __future__ import annotations

import ctypes
import inspect
import mmap
import os
import select
import signal
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe
from types import FrameType
from typing import Any

import hypothesis.strategies as st
import numpy as np
import numpy.typing as npt
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from lean import LeanProcess
from slot_audit import TableSnapshot, lock_is_free, snapshot

from gigashuffle.shm import holders, journal, nodelock, picker, readops, slotmap, slottable, stripes, wideops
from gigashuffle.shm.slottable import EMPTY, FULL, READING, READING_EVICT, WRITING, SlotTable

SLOTS = 10  # small, so that writers run out of empty slots and draws meet the min_full threshold
WRITER, READER = "writer", "reader"
ROLES = (WRITER, WRITER, READER, READER)
MAX_N = 4
# An op executes 20-55 lines of the slot table's modules, a fused one (commit_and_acquire, release_and_draw) up to
# 100: half the kill lines fall in the first 45, where every op is, half in the next 55, where the fused ops' second
# halves are.
# A k past an op's last line lets it finish first.
KILL_AT = st.integers(0, 45) | st.integers(46, 100)
WAIT_S = 30.0  # a child stuck on the lock fails the test instead of hanging it

# Per actor: whether it takes part in the round, n (slots to acquire or draw), a flag (a writer commits rather
# than acquires more; a reader's release evicts) and min_full for a draw (half the time none, so that readers do
# get batches; else up to every slot, so that draws are refused too).
PLAN = st.lists(
    st.tuples(st.booleans(), st.integers(1, MAX_N), st.booleans(), st.just(0) | st.integers(0, SLOTS)),
    min_size=len(ROLES),
    max_size=len(ROLES),
)

# An actor and the line of the slot table's modules it dies at. Two victims in one round let the second die while
# rolling forward the op the first left half-done.
KILL = st.tuples(st.integers(0, len(ROLES) - 1), KILL_AT)
VICTIMS = st.lists(KILL, max_size=2, unique_by=lambda v: v[0])

# What the supervisor does on learning of a death: repair (the registry finds the reaped pids gone), or nothing
# yet. Half the deaths leave their slots held for a while, so that the others work around dead holders and evict()
# meets a dead reader's batch.
HOW = st.sampled_from(["now", "later"])

SETTINGS = settings(
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# The transitions run in shm/slottable.py (their hold of the lock in shm/slotmap.py) and their journal in journal.py,
# the lock in shm/nodelock.py and the slot searches in picker.py: kills land on lines of all of them (an op runs
# about as many lines as when they were one module, so KILL_AT keeps its meaning).
_TRACED = frozenset(
    {
        slottable.__file__, slotmap.__file__, journal.__file__, nodelock.__file__, picker.__file__, holders.__file__,
        stripes.__file__, wideops.__file__, readops.__file__,
    }
)  # fmt: skip
# Every actor pid not yet reaped, whichever example forked it: the fixture kills what an aborted example left.
_UNREAPED: set[int] = set()


def _line_of(function: Callable[..., Any], text: str) -> tuple[str, int]:
    """The file and line of ``function`` (in shm/nodelock.py) containing ``text``; only used to tell whether a kill
    held the lock."""
    lines, first = inspect.getsourcelines(function)
    for number, line in enumerate(lines, start=first):
        if text in line:
            return nodelock.__file__, number
    raise AssertionError(f"{text!r} is no longer in {function.__qualname__}: update the test's lock lines")


_TAKE_LOCK = frozenset(
    {
        _line_of(nodelock.NodeLock._lock_try, "fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)"),
        _line_of(nodelock.NodeLock._lock_wait, "fcntl.flock(self._fd, fcntl.LOCK_EX)"),
        _line_of(nodelock.NodeLock._lock_try, "fcntl.fcntl(self._fd, _F_OFD_SETLK, self._set_lock)"),
        _line_of(nodelock.NodeLock._lock_wait, "fcntl.fcntl(self._fd, _F_OFD_SETLKW, self._set_lock)"),
    }
)  # NOTE [ Stripe locks ]: stripe 0's flock, the others' OFD locks
_DROP_LOCK = frozenset(
    {
        _line_of(nodelock.NodeLock._unlock, "fcntl.flock(self._fd, fcntl.LOCK_UN)"),
        _line_of(nodelock.NodeLock._unlock, "fcntl.fcntl(self._fd, _F_OFD_SETLK, self._unset_lock)"),
    }
)
# The journal's roll-forward (a kill in it is a kill while finishing another's op): its name, checked to exist.
_ROLL_FORWARD = journal.Journal.roll_forward.__name__


# -- the actors' side ---------------------------------------------------------------------------------------------
class _KillAtLine:
    """A trace function that SIGKILLs this process just before the ``at``-th line it runs in the slot table's code.

    It first tells the parent where it is (function, line, whether the lock line has run and the unlock line has
    not, and whether it is rolling forward another's op), so that hypothesis can report where kills landed; the
    parent asserts nothing on it."""

    def __init__(self, at: int, conn: Connection) -> None:
        self.at = at
        self.seen = 0
        self.conn = conn
        self.previous = ("", -1)
        self.lock_held = False

    def __call__(self, frame: FrameType, event: str, arg: object) -> Any:
        # 'call' events of every frame; only the slot table's modules get line events (numpy's code is not counted).
        return self._line if frame.f_code.co_filename in _TRACED else None

    def _line(self, frame: FrameType, event: str, arg: object) -> Any:
        if event != "line":
            return self._line
        # A line has finished once the next one starts, wherever that is (the unlock is followed by the caller's).
        if self.previous in _TAKE_LOCK:
            self.lock_held = True
        elif self.previous in _DROP_LOCK:
            self.lock_held = False
        self.previous = (frame.f_code.co_filename, frame.f_lineno)
        if self.seen == self.at:
            caller: FrameType | None = frame
            rolling = False
            while caller is not None and not rolling:
                rolling, caller = caller.f_code.co_name == _ROLL_FORWARD, caller.f_back
            self.conn.send(("dying", frame.f_code.co_name, frame.f_lineno, self.lock_held, rolling))
            os.kill(os.getpid(), signal.SIGKILL)
        self.seen += 1
        return self._line


def _serve(conn: Connection, table: SlotTable, rows: npt.NDArray[np.int64]) -> None:
    """An actor's loop: one command at a time, until the parent closes the pipe."""
    me = os.getpid()
    while True:
        try:
            op, args, kill_at = conn.recv()
        except (EOFError, ConnectionResetError):  # the test is done with this actor
            return
        if op in ("commit", "commit_acquire"):
            # The row copy: before the commit and outside the lock, as a writer does; never torn by a kill here.
            rows[args[0]] = args[1]
        sys.settrace(_KillAtLine(kill_at, conn) if kill_at is not None else None)
        try:
            if op == "acquire":
                result: Any = table.acquire_empty(me, args)
            elif op == "commit":
                result = table.commit_written(me, args[0])
            elif op == "commit_acquire":
                result = table.commit_and_acquire(me, args[0], args[2])
            elif op == "give_back":
                result = table.give_back(me, args)
            elif op == "draw":
                result = table.draw_full(me, *args)
            elif op == "release":
                result = table.release_read(me, *args)
            elif op == "release_draw":
                result = table.release_and_draw(me, *args)
            elif op == "repair":
                result = table.repair()
            else:
                raise AssertionError(f"unknown command {op}")
        finally:
            sys.settrace(None)
        if op == "draw":
            ids, versions = result
            result = (ids, versions, rows[ids].copy())  # the gather: after the draw, outside the lock
        elif op == "release_draw":
            released, ids, versions = result
            result = (released, ids, versions, rows[ids].copy())
        conn.send(("done", result))


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this child when the test process dies, so no actor outlives a crashed run."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(1)


def _fork_actor(table: SlotTable, rows: npt.NDArray[np.int64], others: list[Connection]) -> tuple[int, Connection]:
    parent_end, child_end = Pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _die_with(parent)
            # Drop the copies of the other actors' parent ends, so that their EOFs depend on the test alone.
            parent_end.close()
            for conn in others:
                conn.close()
            _serve(child_end, table, rows)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _UNREAPED.add(pid)
    child_end.close()
    return pid, parent_end


# -- the parent's side --------------------------------------------------------------------------------------------
def _reap(pid: int) -> int:
    """The wait status of ``pid``, which has exited or been killed; within a deadline (pidfd, no polling)."""
    pidfd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)  # readable once the process has exited
        ready = poller.poll(WAIT_S * 1000)
    finally:
        os.close(pidfd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        _UNREAPED.discard(pid)
        raise AssertionError(f"actor {pid} did not exit within {WAIT_S}s")
    _, status = os.waitpid(pid, 0)
    _UNREAPED.discard(pid)
    return status


def _alive(pid: int) -> bool:
    if os.waitpid(pid, os.WNOHANG) == (0, 0):
        return True
    _UNREAPED.discard(pid)  # it died unasked, and is reaped now: nothing left to kill
    return False


@dataclass
class Actor:
    role: str
    pid: int
    conn: Connection
    held: list[int] = field(default_factory=list)  # a writer's slots being written, or a reader's batch
    marked: set[int] = field(default_factory=set)  # slots of a reader's batch that evict() marked meanwhile


@dataclass
class Reply:
    actor: int
    op: str
    args: Any
    result: Any = None  # None: the actor died
    died_at: tuple[str, int, bool, bool] | None = None  # function, line, lock held, rolling forward


class SlotTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = SlotTable(SLOTS, seed=0)
        self._rows_map = mmap.mmap(-1, SLOTS * 8)  # anonymous and shared: the children see the parent's rows
        self.rows: npt.NDArray[np.int64] = np.frombuffer(self._rows_map, dtype=np.int64)
        self.rows[:] = -1
        self.actors: list[Actor] = []
        for role in ROLES:
            self.actors.append(self._spawn(role))
        self.corpses: list[Actor] = []  # dead (reaped) actors whose slots no repair has returned yet
        self.live: dict[int, tuple[int, int]] = {}  # slot -> (token, version) of the write it holds, full or read
        self.history: dict[int, list[int]] = defaultdict(list)  # slot -> every version committed to it
        self.committed: set[int] = set()
        self.delivered: set[int] = set()
        self.dropped: set[int] = set()
        self.evicted: set[int] = set()
        self.next_token = 1
        self.top_version = 0  # the highest version committed so far
        self.old_versions: set[int] = set()  # every version committed before the current round
        self.new_versions: list[int] = []  # the versions the current round's commits gave out
        # The header's totals: slots committed (rows written), slots released by readers (rows read), and the version
        # clock (slots ever reserved by an acquire).
        self.written = self.read = self.clock = 0

    def _spawn(self, role: str) -> Actor:
        pid, conn = _fork_actor(self.table, self.rows, [a.conn for a in self.actors])
        return Actor(role, pid, conn)

    def teardown(self) -> None:
        # A failed step may have reaped an actor without replacing it: only kill what is still unreaped.
        for actor in self.actors:
            actor.conn.close()
            if actor.pid in _UNREAPED:
                os.kill(actor.pid, signal.SIGKILL)
                _reap(actor.pid)
        self.table.close()

    # -- the model -----------------------------------------------------------------------------------------------
    def _holders(self, role: str) -> list[Actor]:
        return [a for a in (*self.actors, *self.corpses) if a.role == role]

    def _model_empty(self) -> int:
        return SLOTS - len(self.live) - len(self._writing())

    def _model_full(self) -> int:
        return len(self.live) - len(self._batch_of())

    def _writing(self) -> set[int]:
        return {s for a in self._holders(WRITER) for s in a.held}

    def _batch_of(self) -> dict[int, Actor]:
        return {s: a for a in self._holders(READER) for s in a.held}

    def _released(self, actor: Actor, consumed: bool, announced: bool, counted: bool = True) -> None:
        """A reader's batch was given back: slots marked by evict() and, if ``consumed``, all of them left.
        ``counted``: by the reader's release (which counts its rows read), not by a repair."""
        if counted:
            self.read += len(actor.held)
        for slot in actor.held:
            token, _ = self.live[slot]
            if slot in actor.marked or consumed:
                del self.live[slot]
                if announced:
                    assert token not in self.delivered, f"token {token} (slot {slot}) delivered twice"
                    self.delivered.add(token)
                elif slot in actor.marked:
                    self.evicted.add(token)
                else:
                    self.dropped.add(token)  # its release took effect, but its reader died before announcing it
        actor.held, actor.marked = [], set()

    def _committed(self, slots: list[int], tokens: npt.NDArray[np.int64]) -> None:
        self.written += len(slots)
        for slot, token in zip(slots, tokens.tolist(), strict=True):
            version = int(self.table.version[slot])
            assert int(self.rows[slot]) == token
            self.live[slot] = (token, version)
            self.history[slot].append(version)
            self.committed.add(token)
            self.new_versions.append(version)

    def _repaired(self, corpses: list[Actor]) -> None:
        """Repair returned these dead actors' slots: a writer's to empty, a reader's to full unless evicted."""
        for corpse in corpses:
            if corpse.role == READER:
                self._released(corpse, consumed=False, announced=False, counted=False)
            self.corpses.remove(corpse)

    def _expect_empty(self, slots: list[int]) -> None:
        writing = self._writing()
        for slot in slots:
            assert slot not in self.live and slot not in writing, f"acquired slot {slot}, which was not empty"

    def _expect_full(self, slots: list[int]) -> None:
        batch_of = self._batch_of()
        for slot in slots:
            assert slot in self.live and slot not in batch_of, f"drew slot {slot}, which was not full"

    def _receive(self, index: int, op: str, args: Any) -> Reply:
        conn = self.actors[index].conn
        reply = Reply(index, op, args)
        deadline = time.monotonic() + WAIT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not conn.poll(left):
                raise AssertionError(f"actor {index} did not answer {op} within {WAIT_S}s (stuck on the lock?)")
            try:
                message = conn.recv()
            except EOFError:
                return reply
            if message[0] == "dying":
                reply.died_at = message[1:]
                continue
            reply.result = message[1]
            return reply

    # -- the supervisor ------------------------------------------------------------------------------------------
    def _reap_victim(self, reply: Reply) -> None:
        actor = self.actors[reply.actor]
        status = _reap(actor.pid)
        actor.conn.close()
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"actor {reply.actor} ({actor.role}) exited with status {status} instead of being killed (its stderr)"
        )

    def _held_by(self, pid: int) -> list[int]:
        state, holder = self.table.state, self.table.holder
        held = np.isin(state, (WRITING, READING, READING_EVICT)) & (holder == pid)
        return [int(s) for s in np.flatnonzero(held)]

    def _drew(self, actor: Actor, ids: list[int], versions: list[int], tokens: list[int], n: int) -> None:
        assert len(ids) in (0, n) and len(set(ids)) == len(ids)
        self._expect_full(ids)
        for slot, version, token in zip(ids, versions, tokens, strict=True):
            assert (token, version) == self.live[slot], f"slot {slot}: read {token, version}"
        actor.held = ids

    def _settle_fused(self, reply: Reply, part: str, holds: list[int], released: dict[int, bool]) -> None:
        """A reader killed in release_and_draw: the release and the draw are two journaled ops, so it did neither,
        the release alone, or both. Its slots still held tell which: the batch it had (neither; a kept batch drawn
        again whole is the same thing to the model), none (the release), or a new batch (both)."""
        actor = self.actors[reply.actor]
        if part == "release":
            released[reply.actor] = holds != sorted(actor.held)
            event(
                f"a reader killed in release_and_draw: release {'took effect' if released[reply.actor] else 'undone'}"
            )
            if released[reply.actor]:
                self._released(actor, consumed=reply.args[1], announced=False)
        elif released[reply.actor]:
            self._expect_full(holds)  # a draw after the release: it held nothing in between
            actor.held = holds

    def _settle_commit_acquire(self, reply: Reply, part: str, holds: list[int], committed: dict[int, bool]) -> None:
        """A writer killed in commit_and_acquire: the commit and the acquire are two journaled ops, so it did
        neither, the commit alone, or both. Its slots still held tell which: the ones it wrote (neither), none (the
        commit; or both, with nothing left to acquire), or others, all empty before (both)."""
        actor = self.actors[reply.actor]
        if part == "commit":
            mine = sorted(actor.held)
            assert holds == mine or not set(holds) & set(mine), f"a commit half-applied: held {mine}, holds {holds}"
            committed[reply.actor] = holds != mine
            event(f"a writer killed in commit_and_acquire: commit {'took effect' if holds != mine else 'undone'}")
            if committed[reply.actor]:
                self._committed(actor.held, reply.args[1])
                actor.held = []
        elif committed[reply.actor]:
            self._expect_empty(holds)  # an acquire after the commit: it held nothing in between
            actor.held = holds
            self.clock += len(holds)

    def _settle(self, reply: Reply, holds: list[int], old_corpses: list[Actor]) -> None:
        """What a dead actor's last op did, read from what the (rolled forward) table still holds under its pid:
        each op is one journaled transition, so it happened whole or not at all."""
        actor = self.actors[reply.actor]
        mine = sorted(actor.held)
        if reply.op == "commit":
            assert holds in ([], mine), f"a commit half-applied: held {mine}, still holds {holds}"
            event(f"a writer killed in commit_written: {'not ' if holds else ''}committed")
            if not holds:
                self._committed(actor.held, reply.args[1])
                actor.held = []
        elif reply.op == "give_back":
            assert holds in ([], mine), f"a give_back half-applied: held {mine}, still holds {holds}"
            event(f"a writer killed in give_back: {'undone' if holds else 'took effect'}")
            actor.held = holds
        elif reply.op == "acquire":
            assert set(mine) <= set(holds)
            self._expect_empty(sorted(set(holds) - set(mine)))
            actor.held = holds
            self.clock += len(set(holds) - set(mine))
        elif reply.op == "draw":
            self._expect_full(holds)  # it held nothing before
            actor.held = holds
        elif reply.op == "release":
            assert holds in ([], mine), f"a release half-applied: held {mine}, still holds {holds}"
            event(f"a reader killed in release_read: {'undone' if holds else 'took effect'}")
            if not holds:
                self._released(actor, consumed=reply.args[1], announced=False)
        else:
            assert holds == mine
            still = [self._held_by(c.pid) for c in old_corpses]
            done = not any(still)
            assert done or still == [sorted(c.held) for c in old_corpses], f"a repair half-applied: {still}"
            if old_corpses:
                event(f"an actor killed in repair of dead holders: {'took effect' if done else 'undone'}")
            if done:
                self._repaired(old_corpses)

    def _dead_now(self, actors: list[Actor], how: str) -> None:
        """The supervisor learnt of these deaths: repair now, or leave the
        slots held by the dead for a later repair while the others carry on."""
        self.corpses += actors
        if how != "later":
            holding = sum(len(c.held) for c in self.corpses)  # repair returns every dead holder's slots
            # The corpses' pids were reaped within this example (seconds ago at most), far too recently for the
            # kernel's cyclic pid allocator to have handed them out again (the registry's start times would tell).
            assert self.table.repair() == holding
            self._repaired(list(self.corpses))

    # -- rules ---------------------------------------------------------------------------------------------------
    @rule(
        plan=PLAN,
        repairer=st.sampled_from([None] * 6 + list(range(len(ROLES)))),  # seldom: dead slots should linger
        victims=VICTIMS,
        how=HOW,
    )
    def run_round(
        self,
        plan: list[tuple[bool, int, bool, int]],
        repairer: int | None,
        victims: list[tuple[int, int]],
        how: str,
    ) -> None:
        """Some actors run one command each at once; each victim (actor, k) dies at the k-th line of the slot table's
        code that it runs."""
        kill_lines = dict(victims)
        empty_before, full_before = self._model_empty(), self._model_full()
        old_corpses = list(self.corpses)
        sent: list[tuple[int, str, Any]] = []
        for index, (go, n, flag, min_full) in enumerate(plan):
            kill_at = kill_lines.get(index)
            if not go and kill_at is None and repairer != index:
                continue
            actor = self.actors[index]
            args: Any
            if repairer == index:
                op, args = "repair", None  # as a trainer does about once a second
            elif actor.role == WRITER and actor.held and flag:
                tokens = np.arange(self.next_token, self.next_token + len(actor.held), dtype=np.int64)
                self.next_token += len(actor.held)
                # An even n: commit and reserve the next rows' slots under one hold of the lock.
                op = "commit" if n % 2 else "commit_acquire"
                args = (np.array(actor.held, dtype=np.int32), tokens, n)
            elif actor.role == WRITER and actor.held and n == 1:  # a writer gives back slots it did not write
                op, args = "give_back", np.array(actor.held, dtype=np.int32)
            elif actor.role == WRITER:
                op, args = "acquire", n
            elif actor.held and n % 2:
                op, args = "release", (np.array(actor.held, dtype=np.int32), flag)
            elif actor.held:  # an even n: release and draw the next batch under one hold of the lock
                op, args = "release_draw", (np.array(actor.held, dtype=np.int32), flag, n, min_full)
            else:
                op, args = "draw", (n, min_full)
            actor.conn.send((op, args, kill_at))
            sent.append((index, op, args))
        replies = [self._receive(index, op, args) for index, op, args in sent]
        event(f"round of {len(sent)} actors")

        dead = [r for r in replies if r.result is None]
        assert all(r.actor in kill_lines for r in dead), "an actor died unasked"
        holds: dict[int, list[int]] = {}
        for reply in dead:
            self._reap_victim(reply)
            assert reply.died_at is not None, "a victim died without saying where"
            where, _, lock_held, rolling = reply.died_at
            event(f"killed in {reply.op}/{where}, lock {'held' if lock_held else 'not held'}")
            if rolling:
                event("killed while rolling forward the op of an actor killed before it")
            if self.table._header[2]:
                event("a kill left a journaled op for the next lock holder to roll forward")
            snapshot(self.table)  # any op takes the lock, and the first to do so finishes what the dead began
            holds[reply.actor] = self._held_by(self.actors[reply.actor].pid)
        if len(dead) < len(victims):
            event("a victim's op finished before its kill line")
        solo = len(sent) == 1 and not dead

        # Apply the replies in an order that explains any interleaving. A repair touches only the slots of actors
        # dead before the round (a victim dying now is an unreaped zombie, which the registry finds existing); a
        # release may empty or refill a slot that a writer then acquires or a reader draws; a commit may fill a slot a
        # reader then draws. Acquires and draws touch disjoint states, and so do commits and releases.
        # A release_draw is a release and a draw under one hold of the lock, so it explains itself as a release
        # (taking place with the releases) followed by a draw (with the draws).
        # A commit_acquire is likewise a commit followed by an acquire; a give_back empties slots as releases do.
        order = {"repair": 0, "release": 1, "give_back": 1, "commit": 2, "acquire": 3, "draw": 4}
        fused = {"release_draw": ((1, "release"), (4, "draw")), "commit_acquire": ((2, "commit"), (3, "acquire"))}
        steps = [(order[r.op], r.op, r) for r in replies if r.op not in fused]
        steps += [(o, part, r) for r in replies if r.op in fused for o, part in fused[r.op]]
        self.new_versions = []
        fused_done: dict[int, bool] = {}  # fused victims: whether their first op took effect
        for _order, part, reply in sorted(steps, key=lambda step: step[0]):
            actor = self.actors[reply.actor]
            if reply.result is None and reply.op == "release_draw":
                self._settle_fused(reply, part, holds[reply.actor], fused_done)
            elif reply.result is None and reply.op == "commit_acquire":
                self._settle_commit_acquire(reply, part, holds[reply.actor], fused_done)
            elif reply.result is None:
                self._settle(reply, holds[reply.actor], old_corpses)
            elif reply.op == "release_draw" and part == "release":
                assert reply.result[0] == len(actor.held), "a live reader lost slots of its batch"
                self._released(actor, consumed=reply.args[1], announced=True)
            elif reply.op == "release_draw":
                ids, versions, tokens = (x.tolist() for x in reply.result[1:])
                self._drew(actor, ids, versions, tokens, reply.args[2])
            elif reply.op == "commit_acquire" and part == "commit":
                assert reply.result[0] == len(actor.held), "a live writer lost slots it was writing"
                self._committed(actor.held, reply.args[1])
                actor.held = []
            elif reply.op == "commit_acquire":
                ids = reply.result[1].tolist()
                assert len(ids) == len(set(ids)) <= reply.args[2]
                self._expect_empty(ids)
                if solo:  # all or nothing; the commit moved slots from writing to full: as many are empty as before
                    assert len(ids) == (reply.args[2] if empty_before >= reply.args[2] else 0)
                actor.held = ids
                self.clock += len(ids)
            elif reply.op == "give_back":
                assert reply.result == len(actor.held), "a live writer lost slots it had reserved"
                actor.held = []
            elif reply.op == "repair":
                assert reply.result == sum(len(c.held) for c in old_corpses)
                self._repaired(old_corpses)
            elif reply.op == "release":
                assert reply.result == len(actor.held), "a live reader lost slots of its batch"
                self._released(actor, consumed=reply.args[1], announced=True)
            elif reply.op == "commit":
                assert reply.result == len(actor.held), "a live writer lost slots it was writing"
                self._committed(actor.held, reply.args[1])
                actor.held = []
            elif reply.op == "acquire":
                ids = reply.result.tolist()
                assert len(ids) == len(set(ids)) <= reply.args
                self._expect_empty(ids)
                if solo:
                    assert len(ids) == min(reply.args, empty_before)
                actor.held += ids
                self.clock += len(ids)
            else:
                ids, versions, tokens = (x.tolist() for x in reply.result)
                n, min_full = reply.args
                if solo:
                    assert len(ids) == (n if full_before >= max(n, min_full) else 0)
                self._drew(actor, ids, versions, tokens, n)
        # Every write gets a version no other write ever had, whichever writer and however it was committed (the
        # acquire allots them, so a writer that reserved earlier may commit a lower one later: only equality counts).
        assert len(set(self.new_versions)) == len(self.new_versions), self.new_versions
        reused = self.old_versions.intersection(self.new_versions)
        assert not reused, f"versions given to a second write: {sorted(reused)}"
        assert all(v > 0 for v in self.new_versions), self.new_versions  # -1 is evict()'s wildcard
        self.old_versions.update(self.new_versions)
        self.top_version = max([self.top_version, *self.new_versions])

        if dead:
            self._dead_now([self.actors[r.actor] for r in dead], how)
            for reply in dead:
                self.actors[reply.actor] = self._spawn(self.actors[reply.actor].role)

    @rule(indices=st.lists(st.integers(0, len(ROLES) - 1), min_size=1, max_size=len(ROLES), unique=True), how=HOW)
    def kill_idle(self, indices: list[int], how: str) -> None:
        """Actors die between transitions, holding slots but not the lock; several at once (the OOM killer, a
        signal to the process group) leave writers' and readers' slots for one repair to return."""
        dead = [self.actors[i] for i in indices]
        for actor in dead:
            os.kill(actor.pid, signal.SIGKILL)
        for index, actor in zip(indices, dead, strict=True):
            self._reap_victim(Reply(index, "idle", None))
            assert self._held_by(actor.pid) == sorted(actor.held)
        self._dead_now(dead, how)
        for index, actor in zip(indices, dead, strict=True):
            self.actors[index] = self._spawn(actor.role)

    @rule(
        plan=PLAN,
        victims=st.lists(KILL, min_size=1, max_size=2, unique_by=lambda v: v[0]),
        how=HOW,
    )
    def kill_in_round(self, plan: list[tuple[bool, int, bool, int]], victims: list[tuple[int, int]], how: str) -> None:
        """A round in which some actor surely dies (unless its op ends first): kills are what this machine is for."""
        self.run_round(plan, None, victims, how)

    @rule(
        index=st.integers(0, len(ROLES) - 1),
        unnoticed=st.lists(st.integers(0, len(ROLES) - 1), max_size=len(ROLES) - 1, unique=True),
        kill_at=st.none() | KILL_AT,
        how=HOW,
    )
    def actor_repairs(self, index: int, unnoticed: list[int], kill_at: int | None, how: str) -> None:
        """Other actors die idle and the supervisor has not repaired yet; this one's periodic repair() finds them,
        perhaps dying in it. (A repair with nothing to return ends before its journal: only dead holders of both
        kinds make every line of a repair's transition reachable.)"""
        if others := [i for i in unnoticed if i != index]:
            self.kill_idle(others, "later")
        idle = [(False, 1, False, 0)] * len(ROLES)
        self.run_round(idle, index, [] if kill_at is None else [(index, kill_at)], how)

    @rule()
    def supervisor_repair(self) -> None:
        """The supervisor's repair (or a trainer's periodic one): returns exactly the dead holders' slots."""
        holding = sum(len(c.held) for c in self.corpses)
        assert self.table.repair() == holding
        self._repaired(list(self.corpses))

    @rule(
        picks=st.lists(
            st.tuples(
                st.integers(0, SLOTS - 1),
                st.booleans(),
                st.sampled_from(["current", "stale", "any", "unknown"]),
            ),
            min_size=1,
            max_size=4,
        ),
        with_versions=st.booleans(),
    )
    def evict(self, picks: list[tuple[int, bool, str]], with_versions: bool) -> None:
        """evict() as an INDEX_KEY entry drives it: a stale version (the slot was rewritten since) changes nothing."""
        batch_of = self._batch_of()
        being_read = sorted(batch_of)
        if any(c.role == READER and c.held for c in self.corpses):
            event("evict() while a dead reader's batch awaits repair")
        ids, versions, stale = [], [], False
        for index, read, kind in picks:
            # Half the picks aim at slots being read (by live or dead readers), which random ids rarely hit.
            slot = being_read[index % len(being_read)] if read and being_read else index
            current = self.live[slot][1] if slot in self.live else None
            older = [v for v in self.history[slot] if v != current]
            if kind == "current" and current is not None:
                version = current
            elif kind == "stale" and older:
                version, stale = older[-1], True
            elif kind == "any":
                version = -1
            else:
                version = self.top_version + 1 + slot  # no write has it
            ids.append(slot)
            versions.append(version)
        expected = set()
        for slot, version in zip(ids, versions, strict=True):
            if slot not in self.live or (slot in batch_of and slot in batch_of[slot].marked):
                continue  # only full slots and unmarked slots being read
            if not with_versions or version in (-1, self.live[slot][1]):
                expected.add(slot)
        got = self.table.evict(np.array(ids, dtype=np.int32), np.array(versions) if with_versions else None)
        assert got == len(expected)
        if with_versions and stale:
            event("evict() with a stale version")
        for slot in expected:
            if slot in batch_of:
                batch_of[slot].marked.add(slot)  # a live reader's, or a dead one's awaiting repair
                event(
                    f"evict() marked a slot being read by a {'live' if batch_of[slot] in self.actors else 'dead'} one"
                )
            else:
                self.evicted.add(self.live.pop(slot)[0])

    # -- invariants ----------------------------------------------------------------------------------------------
    @invariant()
    def table_matches_model(self) -> None:
        table = self.table
        # Before anything here takes the lock: no transition is left half-done between steps.
        assert int(table._header[2]) == 0, "a journaled op was left for later"
        assert lock_is_free(table), "someone still holds the node lock between steps"
        state, holder, version = table.state.copy(), table.holder.copy(), table.version.copy()
        assert np.isin(state, (EMPTY, WRITING, FULL, READING, READING_EVICT)).all(), state
        counts = np.bincount(state, minlength=5)
        snap = snapshot(table)
        assert snap == TableSnapshot(int(counts[EMPTY]), int(counts[WRITING]), int(counts[FULL]),
                                         int(counts[READING] + counts[READING_EVICT]))  # fmt: skip
        assert snap.empty + snap.writing + snap.full + snap.reading == SLOTS
        assert int(table._header[journal.H_FULL]) == counts[FULL], "the stored count of full slots drifted"
        assert int(table._header[journal.H_EMPTY]) == counts[EMPTY], "the stored count of empty slots drifted"
        header = table._header
        assert int(header[journal.H_WRITTEN]) == self.written, (
            f"rows written {header[journal.H_WRITTEN]}, model {self.written}"
        )
        assert int(header[journal.H_READ]) == self.read, f"rows read {header[journal.H_READ]}, model {self.read}"
        assert int(header[journal.H_CLOCK]) == self.clock, (
            f"version clock {header[journal.H_CLOCK]}, model {self.clock}"
        )

        expected = np.full(SLOTS, EMPTY, dtype=np.uint8)
        for slot, (token, written) in self.live.items():
            expected[slot] = FULL
            assert version[slot] == written, f"slot {slot}: version {version[slot]}, model {written}"
            assert self.rows[slot] == token, f"slot {slot}: row holds {self.rows[slot]}, model {token}"
        for actor in self.actors:
            assert _alive(actor.pid), f"{actor.role} {actor.pid} died unnoticed"
        for corpse in self.corpses:
            assert corpse.pid not in _UNREAPED
        # Every slot being written or read is held by a live actor, or by a dead one awaiting repair.
        for actor in (*self.actors, *self.corpses):
            for slot in actor.held:
                if actor.role == WRITER:
                    expected[slot] = WRITING
                else:
                    expected[slot] = READING_EVICT if slot in actor.marked else READING
                assert holder[slot] == actor.pid, f"slot {slot} held by {holder[slot]}, model {actor.pid}"
        wrong = np.flatnonzero(state != expected)
        assert not wrong.size, f"slots {wrong.tolist()}: states {state[wrong].tolist()}, model {expected[wrong]}"

        tokens = [token for token, _ in self.live.values()]
        assert len(set(tokens)) == len(tokens), "one write in two slots"
        parts = (self.delivered, self.dropped, self.evicted, set(tokens))
        assert sum(len(p) for p in parts) == len(self.committed), "a token counted twice"
        assert set().union(*parts) == self.committed, f"tokens lost: {self.committed - set().union(*parts)}"


def run_machine() -> None:
    """The machine's examples (run in the lean process); then kill and reap any actor an aborted example left behind
    (teardown normally does it)."""
    try:
        run_state_machine_as_test(SlotTableMachine, settings=SETTINGS)
    finally:
        for pid in list(_UNREAPED):
            os.kill(pid, signal.SIGKILL)
            _reap(pid)
    assert not _UNREAPED


# The examples run in a lean interpreter (tests/lean.py): every actor, and every replacement of a killed one, is a
# fork, which costs about half as much there as from a pytest worker that imported every test module.
def test_slot_table_machine(lean: LeanProcess) -> None:
    lean.call(__name__, "run_machine")
