"""The slot table: what each row of the node buffer holds, in shared memory beside the rows.

NOTE [ Slot table ]
One anonymous memfd per node buffer, created with it and handed out with it at attach. Per slot: ``state`` (uint8:
empty, writing, full, reading, reading-then-evict), ``holder`` (int32 pid of the writer or reader that holds it),
``writer`` (int32 pid of the writer that last wrote it, stamped with the version, read by a reader after its draw to
count the distinct writers of a batch for ``loader.metrics()``) and ``version`` (int64, a fresh value for every
write, so an INDEX_KEY entry names one write of a slot: the acquire that reserves a slot allots it, and the writer
stamps it on the slot before the commit makes it full). Every transition is a few vectorized numpy statements on an
array of slot ids, under one node lock (``flock`` on the memfd, which the kernel drops when its holder dies; see
shm/nodelock.py). The lock is held for tens of microseconds and never across a row copy; the node's transitions are
serial, so their total is what bounds a node's rate of small rows whatever its cores (NOTE [ Node lock budget ]).

Every transition is journaled, so a holder killed at any instruction loses no slot and blocks nobody (NOTE
[ Slot journal ] in shm/journal.py); ``stats()`` reads the header's counts under the lock. Who holds slots is
known by pid and start time (NOTE [ Holder registry ] in shm/holders.py), so repair finds the dead without a pass
over the table and a reused pid is never taken for its dead predecessor.

NOTE [ A stopped lock holder ]
A dead holder never blocks the node; a stopped one (SIGSTOP, a debugger at a breakpoint, a frozen cgroup) does,
and no process can take a live one's flock. What the trainer guarantees is that it says so instead of hanging:
``counts()`` reads the header without the lock (the heartbeat and the fill progress use it, so the node's session
stays alive); the trainer's own transitions have a patience (``wait_s``): repairing a dead child's slots waits
about a second and otherwise leaves them to the children's housekeeping, ``stats()`` and ``evict()`` raise
``NodeLockBusy`` naming the holder and its state; and the "no batch for N s" warning names the holder. Writers and
readers wait without a limit: they have nothing else to do, and the holder may go on.

What a transition costs (it runs under the node lock, a few times per batch and chunk): a dozen numpy calls on
the op's slot ids (``take``/``compress`` rather than fancy and boolean indexing, half the cost at these sizes),
never a sort and never a pass over the whole table. ``acquire_empty`` scans forward from where this process's
last search stopped, in windows sized from the count of empty slots, so it usually finds its slots in one numpy
call over about ``1.5 * n / (fraction empty)`` states (each further window doubles); ``draw_full`` samples by
rejection (both in shm/picker.py). Both searches run before the lock is taken, and under it the transition only
checks their result (NOTE [ Node lock budget ]). The hot ops take the lock with ``_acquire``/``_release`` rather
than the generator context manager ``_locked`` (a few microseconds per use); a reader returns a batch and draws
the next under one hold (``release_and_draw``), and a writer publishes a chunk and reserves the slots of the next
under one (``commit_and_acquire``; ``give_back`` returns a reservation).

NOTE [ Node lock budget ]
Every writer and reader of a node takes the one lock, so the sum of their hold times per second is the share of
the node's time that no other transition can run in, and a node with any number of cores tops out near
1 / (busy share) times the rate that share was measured at. The header totals every process's holds and their
time (``lock_usage()``; two stores per hold, not journaled), and ``gigashuffle bench`` reports the share over its
window. So whatever does not need the table's state is done outside the lock:
- a reader draws its random candidate ids, drops repeats and keeps the ones full now before it takes the lock
  (``SlotPicker.candidates``, sized from the count of full slots read without the lock); under it the states of
  the first ``n`` are checked once, and only if one of them is no longer full are the others checked and more
  drawn (the table changed meanwhile);
- a writer searches for its empty slots before it takes the lock (``first_empty`` from its cursor, sized from the
  count of empty slots read without it); under it one gather of their states checks that all are still empty,
  which they are unless another writer took one meanwhile (only an acquire moves a slot out of empty), and
  only then does the search run again, under the lock, from the same cursor (``_take_empty``);
- a drawn slot's version is read after the lock is released (``_versions_of_drawn``);
- a process checks that it still holds the slots it commits or releases before it takes the lock (``_held``:
  while it lives, nobody else moves them out of writing or reading);
- an acquire only moves the version clock (journaled); the writer stamps the new versions on its reserved slots
  after the release (``_stamp_versions``), so a commit just marks its slots full;
- the journal reads and writes the header's words through a memoryview (shm/journal.py), a third of a numpy
  scalar access each, about fifteen per op.
Today (docs/benchmarks.md, "The node lock guards only the transition", measured with ``python -m
gigashuffle.tools.bench.runner --workload W --seconds 5 --no-baselines --writers 1 --readers 1`` on the 2-core
VM) the lock is held 12-14 ns per delivered row on tiny rows (mean hold 13 us) and 104-134 ns on token rows
(6-7 us): a ceiling of about 75-85M and 7.5-9.6M rows/s whatever the node's cores. What is left under it is the
transitions' own stores (the journal's ids, the states and holders of the op's slots, the header's words) and a
reader's one check of its candidates' states; on token rows a reader's hold is three fixed costs of about 1.4 us
(release, check, draw) per 64-row batch.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from gigashuffle.host.pids import process_start
from gigashuffle.shm.holders import REGISTRY_ROWS
from gigashuffle.shm.journal import (
    H_CLOCK,
    H_EMPTY,
    H_FULL,
    OP_ACQUIRE,
    OP_COMMIT,
    OP_DRAW,
    OP_EVICT,
    OP_GIVE_BACK,
    OP_RELEASE_EVICT,
    OP_RELEASE_KEEP,
    OP_REPAIR,
)
from gigashuffle.shm.lanes import NO_LANE
from gigashuffle.shm.picker import EMPTY, FULL, NO_IDS, READING, READING_EVICT, WRITING, SlotIds
from gigashuffle.shm.slotmap import LockUsage, ShuffleBufferStats, SlotMap, Versions, table_nbytes

__all__ = [
    "EMPTY", "FULL", "READING", "READING_EVICT", "WRITING", "LockUsage",
    "ShuffleBufferStats", "SlotIds", "SlotTable", "Versions", "table_nbytes",
]  # fmt: skip

_NO_VERSIONS: Versions = np.empty(0, dtype=np.int64)


class SlotTable(SlotMap):
    """The slot table of one node buffer. ``memory=None`` creates it (every slot empty); else it maps ``memory``."""

    def _held(self, pid: int, ids: npt.ArrayLike, states: tuple[int, ...]) -> SlotIds:
        """The slots of ``ids`` that ``pid`` holds in one of ``states``. Called before the lock is taken, by
        ``pid`` itself about its own slots: while it lives no other process moves them out of those states (evict
        marks a reading slot reading-then-evict, both accepted; repair takes a holder's slots only once it is
        dead: a pid it is given is one the zygote reaped), so the answer is the one the lock would give, without
        costing the node's lock time (NOTE [ Node lock budget ]). Should a count drift all the same, a draw
        raises instead of spinning (``SlotPicker._listed_full``)."""
        given: SlotIds = np.asarray(ids, dtype=np.intp)
        if given.ndim != 1:
            given = given.reshape(-1)
        # Comparisons instead of np.isin, which sorts or builds a table per call (it dominated the commits and
        # releases of small batches); reading and reading-then-evict are the two highest states: one comparison.
        # take() and compress() rather than fancy and boolean indexing: half the cost at these sizes.
        now = self.state.take(given)
        if states == (READING, READING_EVICT):
            in_state = now >= READING
        else:
            in_state = now == states[0]
            for other in states[1:]:
                in_state |= now == other
        in_state &= self.holder.take(given) == pid
        if np.count_nonzero(in_state) == len(given):  # the usual case: skip the copy (count_nonzero: not .all())
            return given
        mine: SlotIds = given.compress(in_state)
        return mine

    # -- writers ---------------------------------------------------------------------------------------------
    def acquire_empty(self, pid: int, n: int) -> SlotIds:
        """Up to ``n`` empty slots, now ``writing`` under ``pid``."""
        words = self._journal.words
        cursor = self._picker.cursor
        found = self._picker.first_empty(self.state, words[H_EMPTY], n)  # before the lock: _take_empty
        self._acquire()
        try:
            if pid not in self._holders.known:
                self._register(pid)
            empty = words[H_EMPTY]
            ids = self._take_empty(n, empty, found, cursor)
            self._journal.commit(OP_ACQUIRE, pid, ids, -1, empty - len(ids))
            clock = words[H_CLOCK]
        finally:
            self._release()
        self._stamp_versions(pid, ids, clock)
        return ids

    def _take_empty(self, n: int, empty: int, found: SlotIds, cursor: int) -> SlotIds:
        """Under the lock: ``min(n, empty)`` empty slots. ``found`` is the search made before the lock from
        ``cursor`` (NOTE [ Node lock budget ]): between it and the lock, a slot leaves ``empty`` only when another
        writer acquires it, so if ``found`` has as many slots as are wanted and every one is still empty (one
        gather of states; empty is 0), they are taken as they are; otherwise the search runs again from
        ``cursor``, as it did under the lock before."""
        if len(found) == min(n, empty) and not np.count_nonzero(self.state.take(found)):
            return found
        self._picker.cursor = cursor
        return self._picker.first_empty(self.state, empty, n)

    def commit_written(self, pid: int, ids: npt.ArrayLike, lane: int = NO_LANE) -> int:
        """Publish slots ``pid`` wrote (with the versions stamped at acquire); returns how many it still held.
        ``lane`` grows by that many (NOTE [ Lanes ] in shm/lanes.py)."""
        mine = self._held(pid, ids, (WRITING,))
        self._acquire()
        try:
            self._commit_written(pid, mine, lane)
        finally:
            self._release()
        return len(mine)

    def commit_and_acquire(
        self, pid: int, ids: npt.ArrayLike, n: int, min_full: int = 0, lane: int = NO_LANE
    ) -> tuple[int, SlotIds]:
        """``commit_written``, then ``n`` empty slots for ``pid``'s next rows if that many are empty and the slots
        full or empty without them still number ``min_full``, else none, under one hold of the lock (two journaled
        ops). All or nothing: a writer that took the few slots just emptied would cut its next chunk into as many
        small pieces, each a copy and a transition of its own. ``min_full``: a reservation held while the dataset
        waits must not keep the buffer from reaching the readers' threshold (with fill_once, every slot).
        Returns how many slots it still held, and the new ones."""
        mine = self._held(pid, ids, (WRITING,))
        words, picker = self._journal.words, self._picker
        cursor = picker.cursor
        # The search before the lock (NOTE [ Node lock budget ]), where the counts read without it say that the
        # reservation will be made: a writer polling a full buffer searches nothing.
        empty = words[H_EMPTY]
        likely = 0 < n <= empty and words[H_FULL] + len(mine) + empty - n >= min_full
        found = picker.first_empty(self.state, empty, n) if likely else NO_IDS
        self._acquire()
        try:
            if pid not in self._holders.known:
                self._register(pid)
            self._commit_written(pid, mine, lane)
            empty = words[H_EMPTY]
            room = words[H_FULL] + empty - n >= min_full
            if 0 < n <= empty and room:
                fresh = self._take_empty(n, empty, found, cursor)
            else:
                fresh, picker.cursor = NO_IDS, cursor
            self._journal.commit(OP_ACQUIRE, pid, fresh, -1, empty - len(fresh))
            clock = words[H_CLOCK]
        finally:
            self._release()
        self._stamp_versions(pid, fresh, clock)
        return len(mine), fresh

    def _stamp_versions(self, pid: int, ids: SlotIds, clock: int) -> None:
        # The acquire moved the version clock to ``clock`` past len(ids) values of its own (journaled); the writer
        # stamps them on its reserved slots after releasing the lock (NOTE [ Node lock budget ]). Nobody reads the
        # version of a writing slot, and the commit that makes them full comes later from this same process. A
        # writer killed before or while stamping leaves writing slots that repair empties: no row has them.
        # Its pid goes with them, for the readers' count of writers per batch (a figure only: nothing depends on it).
        if len(ids):
            self.version[ids] = np.arange(clock - len(ids) + 1, clock + 1, dtype=np.int64)
            self.writer[ids] = pid  # fancy assignment, not put(): a third of the cost at these sizes

    def _commit_written(self, pid: int, mine: SlotIds, lane: int) -> None:
        self._journal.commit(OP_COMMIT, pid, mine, self._journal.words[H_FULL] + len(mine), -1, lane, len(mine))

    def give_back(self, pid: int, ids: npt.ArrayLike) -> int:
        """Return slots ``pid`` acquired and did not write (``writing`` -> ``empty``); returns how many it held."""
        mine = self._held(pid, ids, (WRITING,))
        self._acquire()
        try:
            self._journal.commit(OP_GIVE_BACK, pid, mine, -1, self._journal.words[H_EMPTY] + len(mine))
        finally:
            self._release()
        return len(mine)

    # -- readers ---------------------------------------------------------------------------------------------
    def draw_full(self, pid: int, n: int, min_full: int = 0) -> tuple[SlotIds, Versions]:
        """``n`` uniformly random full slots, now ``reading`` under ``pid``, with their versions; none while fewer
        than ``max(n, min_full)`` slots are full."""
        candidates = self._picker.candidates(n, self._journal.words[H_FULL], min_full, self.state)
        self._acquire()
        try:
            ids = self._draw(pid, n, min_full, candidates)
        finally:
            self._release()
        return ids, self._versions_of_drawn(ids)

    def _draw(self, pid: int, n: int, min_full: int, candidates: SlotIds) -> SlotIds:
        full = self._journal.words[H_FULL]
        if n <= 0 or full < max(n, min_full):
            return NO_IDS
        if pid not in self._holders.known:
            self._register(pid)
        ids = self._picker.sample_full(self.state, n, full, candidates)
        self._journal.commit(OP_DRAW, pid, ids, full - n)
        return ids

    def _versions_of_drawn(self, ids: SlotIds) -> Versions:
        # Read after the lock is released: a slot reading under this process keeps its version (only the writer
        # that reserved a slot sets one; evict and repair change states, never versions), and a random gather of
        # 8-byte words is one of the costlier steps of a draw that every process of the node waits for
        # (NOTE [ Node lock budget ]).
        return self.version[ids] if len(ids) else _NO_VERSIONS

    def release_read(self, pid: int, ids: npt.ArrayLike, evict: bool, lane: int = NO_LANE, batches: int = 0) -> int:
        """Return slots ``pid`` read: to empty if ``evict`` (or evict() marked them), else to full. ``lane`` grows by
        ``batches`` (NOTE [ Lanes ] in shm/lanes.py)."""
        mine = self._held(pid, ids, (READING, READING_EVICT))
        self._acquire()
        try:
            self._release_read(pid, mine, evict, lane, batches)
        finally:
            self._release()
        return len(mine)

    def release_and_draw(
        self,
        pid: int,
        ids: npt.ArrayLike,
        evict: bool,
        n: int,
        min_full: int = 0,
        lane: int = NO_LANE,
        batches: int = 0,
    ) -> tuple[int, SlotIds, Versions]:
        """``release_read`` then ``draw_full`` under one hold of the lock (two journaled ops): a reader with a free
        ring slot takes its next batch as it returns the last. Returns how many it still held, and the draw."""
        mine = self._held(pid, ids, (READING, READING_EVICT))
        candidates = self._picker.candidates(n, self._journal.words[H_FULL], min_full, self.state)
        self._acquire()
        try:
            self._release_read(pid, mine, evict, lane, batches)
            drawn = self._draw(pid, n, min_full, candidates)
        finally:
            self._release()
        return len(mine), drawn, self._versions_of_drawn(drawn)

    def _release_read(self, pid: int, mine: SlotIds, evict: bool, lane: int, batches: int) -> None:
        words = self._journal.words
        empty = words[H_EMPTY]
        if evict:
            self._journal.commit(OP_RELEASE_EVICT, pid, mine, -1, empty + len(mine), lane, batches)
        else:  # slots evict() marked meanwhile become empty, the others full again
            back = int(np.count_nonzero(self.state.take(mine) == READING))
            full = words[H_FULL] + back
            self._journal.commit(OP_RELEASE_KEEP, pid, mine, full, empty + len(mine) - back, lane, batches)

    def evict(self, ids: npt.ArrayLike, versions: npt.ArrayLike | None = None, wait_s: float | None = None) -> int:
        """Full slots become empty; slots being read become empty when released. A slot whose version is not the
        given one (rewritten since) is left alone; version -1 (or ``versions=None``) matches any write."""
        ids = np.asarray(ids, dtype=np.intp).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.slots):
            raise ValueError(f"slot ids must lie in [0, {self.slots}), got [{ids.min()}, {ids.max()}]")
        with self._locked(wait_s):
            ok = np.isin(self.state[ids], (FULL, READING))
            if versions is not None:
                wanted = np.asarray(versions, dtype=np.int64).reshape(-1)
                ok &= (wanted == -1) | (self.version[ids] == wanted)
            chosen = np.unique(ids[ok])
            gone = int(np.count_nonzero(self.state[chosen] == FULL))
            header = self._header
            self._journal.commit(OP_EVICT, 0, chosen, int(header[H_FULL]) - gone, int(header[H_EMPTY]) + gone)
        return len(chosen)

    # -- supervision -----------------------------------------------------------------------------------------
    def _register(self, pid: int) -> None:
        """Enter ``pid`` in the holder registry before a transition gives it slots; under the lock (NOTE [ Holder
        registry ] in shm/holders.py)."""
        holders = self._holders
        row, start = holders.lookup(pid)
        if row >= 0 and start != 0 and start == process_start(pid):  # registered already (another mapping)
            holders.known.add(pid)
            return
        if row >= 0:  # an earlier process with this pid is gone: what it held is not this process's
            self._repair_locked([pid])
        else:
            row = holders.free_row()
            if row < 0:
                gone = holders.gone()
                self._repair_locked(gone)
                holders.forget(gone)
                row = holders.free_row()
            if row < 0:
                raise RuntimeError(f"more than {REGISTRY_ROWS} live processes hold slots of one node buffer")
        holders.claim(pid, row)

    def repair(self, wait_s: float | None = None, scan: bool = False) -> int:
        """Return the slots of holders that no longer exist; returns how many. A holder is its pid and start time
        (NOTE [ Holder registry ] in shm/holders.py): a live process that reuses a dead one's pid keeps its slots.
        Without a death this reads /proc once per registered holder and takes no lock, so the supervisor calls it
        whenever the zygote reports a child reaped, and each child about once a second. ``scan``: the rare
        fallback, also a pass over every slot for holders the registry does not name as existing."""
        if not scan and not self._holders.gone():
            return 0
        with self._locked(wait_s):
            gone = self._holders.gone()  # again under the lock: a row may have been repaired or taken over
            if scan:
                alive = self._holders.alive()
                held = np.flatnonzero((self.state != EMPTY) & (self.state != FULL))
                gone = sorted(set(gone) | {p for p in np.unique(self.holder[held]).tolist() if p not in alive})
            repaired = self._repair_locked(gone)
            self._holders.forget(gone)  # after the repair's commit: a kill in between leaves a row to repair again
        return repaired

    def _repair_locked(self, pids: list[int]) -> int:
        """Return the slots held under ``pids`` (gone processes): one compare over the holder column."""
        if not pids:
            return 0
        hit = self.holder == pids[0] if len(pids) == 1 else np.isin(self.holder, pids)
        candidates = np.flatnonzero(hit)
        now = self.state.take(candidates)
        ids = candidates.compress((now != EMPTY) & (now != FULL))
        back = int(np.count_nonzero(self.state.take(ids) == READING))
        header = self._header  # writing and reading-then-evict slots become empty, reading ones full
        self._journal.commit(OP_REPAIR, 0, ids, int(header[H_FULL]) + back, int(header[H_EMPTY]) + len(ids) - back)
        return len(ids)

    def stats(self, wait_s: float | None = None) -> ShuffleBufferStats:
        """The slot counts at one moment: the header's counts read under the lock, which every transition keeps
        exact (journaled with it), so this costs the same for any table size."""
        self._acquire(wait_s)
        try:
            return self.counts()[2]  # under the lock no transition is half done: the counts agree
        finally:
            self._release()

    def full_ids(self, wait_s: float | None = None) -> SlotIds:
        """The slots that are full right now (a checkpoint's copy of the buffer: NOTE [ Checkpoint cut ])."""
        with self._locked(wait_s):
            return np.flatnonzero(self.state == FULL)
