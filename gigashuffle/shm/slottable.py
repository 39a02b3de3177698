"""The slot table: what each row of the node buffer holds, in shared memory beside the rows.

NOTE [ Slot table ]
One anonymous memfd per node buffer, created with it and handed out with it at attach. Per slot: ``state`` (uint8:
empty, writing, full, reading, reading-then-evict), ``holder`` (int32 pid of the writer or reader that holds it),
``writer`` (int32 pid of the writer that last wrote it, stamped with the version, read by a reader after its draw to
count the distinct writers of a batch for ``loader.metrics()``) and ``version`` (int64, a fresh value for every
write, so an INDEX_KEY entry names one write of a slot: the acquire that reserves a slot allots it, and the writer
stamps it on the slot before the commit makes it full). Every transition is a few vectorized numpy statements on an
array of slot ids, under the lock of the stripe of the table they lie in (NOTE [ Stripes ] in shm/stripes.py: one
stripe for tables under 32,768 slots, whose lock is the ``flock`` on the memfd, which the kernel drops when its
holder dies; see shm/nodelock.py). A lock is held for microseconds and never across a row copy; the transitions of
one stripe are serial, so the busiest stripe's total is what bounds a node's rate of small rows whatever its cores
(NOTE [ Node lock budget ]).

Every transition is journaled, so a holder killed at any instruction loses no slot and blocks nobody (NOTE
[ Slot journal ] in shm/journal.py); ``stats()`` reads the stripes' counts under every lock. Who holds slots is
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
Every writer and reader of a node takes a stripe's lock per op, so the sum of a stripe's hold times per second is
the share of the node's time that no other transition of that stripe can run in, and a node with any number of
cores tops out near 1 / (the busiest stripe's busy share) times the rate that share was measured at. Each stripe's
header totals every process's holds and their time (``lock_usage()``; two stores per hold, not journaled), and
``gigashuffle bench`` reports the shares over its window. So whatever does not need the table's state is done
outside the lock (and the choice of a stripe, from its counts read without a lock):
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

from gigashuffle.shm.journal import (
    H_CLOCK,
    H_EMPTY,
    H_FULL,
    OP_ACQUIRE,
    OP_COMMIT,
    OP_GIVE_BACK,
)  # fmt: skip
from gigashuffle.shm.lanes import NO_LANE
from gigashuffle.shm.picker import EMPTY, FULL, NO_IDS, READING, READING_EVICT, WRITING, SlotIds
from gigashuffle.shm.readops import ReadOps
from gigashuffle.shm.slotmap import Versions, table_nbytes
from gigashuffle.shm.stripes import Stripe
from gigashuffle.shm.tablereadings import LockUsage, ShuffleBufferStats

__all__ = [
    "EMPTY", "FULL", "READING", "READING_EVICT", "WRITING", "LockUsage",
    "ShuffleBufferStats", "SlotIds", "SlotTable", "Versions", "table_nbytes",
]  # fmt: skip


class SlotTable(ReadOps):
    """The slot table of one node buffer. ``memory=None`` creates it (every slot empty); else it maps ``memory``.
    The writers' ops are here, the readers' are ``ReadOps``' (shm/readops.py), and those that take every stripe's
    lock ``WideOps``' (shm/wideops.py, NOTE [ Stripes ] in shm/stripes.py)."""

    # -- writers ---------------------------------------------------------------------------------------------
    def acquire_empty(self, pid: int, n: int) -> SlotIds:
        """Up to ``n`` empty slots, now ``writing`` under ``pid`` (all in one stripe)."""
        self._register_once(pid)
        stripe = self._for_writer(n)
        words, picker, local = stripe.words, stripe.picker, self._local(stripe)
        cursor = picker.cursor
        found = picker.first_empty(local, words[H_EMPTY], n)  # before the lock: _take_empty
        self._take(stripe)
        try:
            empty = words[H_EMPTY]
            ids = self._take_empty(stripe, n, empty, found, cursor)
            stripe.journal.commit(OP_ACQUIRE, pid, ids, -1, empty - len(ids))
            clock = words[H_CLOCK]
        finally:
            stripe.release()
        self._stamp_versions(stripe, pid, ids, clock)
        return ids

    def _take_empty(self, stripe: Stripe, n: int, empty: int, found: SlotIds, cursor: int) -> SlotIds:
        """Under the stripe's lock: ``min(n, empty)`` of its empty slots (table ids). ``found`` is the search made
        before the lock from ``cursor`` (NOTE [ Node lock budget ]; stripe ids): between it and the lock, a slot
        leaves ``empty`` only when another writer acquires it, so if ``found`` has as many slots as are wanted and
        every one is still empty (one gather of states; empty is 0), they are taken as they are; otherwise the
        search runs again from ``cursor``, as it did under the lock before."""
        local = self._local(stripe)
        if not (len(found) == min(n, empty) and not np.count_nonzero(local.take(found))):
            stripe.picker.cursor = cursor
            found = stripe.picker.first_empty(local, empty, n)
        return found + stripe.lo if stripe.lo else found

    def commit_written(self, pid: int, ids: npt.ArrayLike, lane: int = NO_LANE) -> int:
        """Publish slots ``pid`` wrote (with the versions stamped at acquire); returns how many it still held.
        ``lane`` grows by that many (NOTE [ Lanes ] in shm/lanes.py), run by run (NOTE [ Stripes ])."""
        mine = self._held(pid, ids, (WRITING,))
        for stripe, run in self._runs(mine):
            self._take(stripe)
            try:
                self._commit_written(stripe, pid, run, lane)
            finally:
                stripe.release()
        return len(mine)

    def commit_and_acquire(
        self, pid: int, ids: npt.ArrayLike, n: int, min_full: int = 0, lane: int = NO_LANE
    ) -> tuple[int, SlotIds]:
        """``commit_written``, then ``n`` empty slots of one stripe for ``pid``'s next rows if that many are empty
        there and the slots full or empty without them still number ``min_full``, else none; the last run's
        commit and the reservation share a hold of the lock when they are in one stripe. All or nothing: a writer
        that took the few slots just emptied would cut its next chunk into as many small pieces, each a copy and a
        transition of its own. ``min_full``: a reservation held while the dataset waits must not keep the buffer
        from reaching the readers' threshold (with fill_once, every slot). Returns how many slots it still held,
        and the new ones."""
        mine = self._held(pid, ids, (WRITING,))
        runs = self._runs(mine)
        if n <= 0:
            for stripe, run in runs:
                self._take(stripe)
                try:
                    self._commit_written(stripe, pid, run, lane)
                finally:
                    stripe.release()
            return len(mine), NO_IDS
        self._register_once(pid)
        target = self._for_writer(n)
        words, picker = target.words, target.picker
        cursor = picker.cursor
        # The search before the lock (NOTE [ Node lock budget ]), where the counts read without it say that the
        # reservation will be made: a writer polling a full buffer searches nothing.
        empty = words[H_EMPTY]
        likely = 0 < n <= empty and self._reachable(len(mine)) - n >= min_full
        found = picker.first_empty(self._local(target), empty, n) if likely else NO_IDS
        for stripe, run in runs if not runs or runs[-1][0] is not target else runs[:-1]:
            self._take(stripe)
            try:
                self._commit_written(stripe, pid, run, lane)
            finally:
                stripe.release()
        self._take(target)
        try:
            if runs and runs[-1][0] is target:
                self._commit_written(target, pid, runs[-1][1], lane)
            empty = words[H_EMPTY]
            if 0 < n <= empty and self._reachable(0) - n >= min_full:
                fresh = self._take_empty(target, n, empty, found, cursor)
            else:
                fresh, picker.cursor = NO_IDS, cursor
            target.journal.commit(OP_ACQUIRE, pid, fresh, -1, empty - len(fresh))
            clock = words[H_CLOCK]
        finally:
            target.release()
        self._stamp_versions(target, pid, fresh, clock)
        return len(mine), fresh

    def _reachable(self, extra: int) -> int:
        """Slots full or empty now (each stripe's words; exact for a stripe whose lock is held), plus ``extra``."""
        return extra + sum(s.words[H_FULL] + s.words[H_EMPTY] for s in self._stripes)

    def _stamp_versions(self, stripe: Stripe, pid: int, ids: SlotIds, clock: int) -> None:
        # The acquire moved the stripe's version clock to ``clock`` past len(ids) values of its own (journaled);
        # the writer stamps them on its reserved slots after releasing the lock (NOTE [ Node lock budget ]):
        # ``clock * stripes + k`` in stripe k, unique over the table (NOTE [ Stripes ]). Nobody reads the version of
        # a writing slot, and the commit that makes them full comes later from this same process. A writer killed
        # before or while stamping leaves writing slots that repair empties: no row has them.
        # Its pid goes with them, for the readers' count of writers per batch (a figure only: nothing depends on it).
        if len(ids):
            versions = np.arange(clock - len(ids) + 1, clock + 1, dtype=np.int64)
            if self.stripes > 1:
                versions *= self.stripes
                versions += stripe.k
            self.version[ids] = versions
            self.writer[ids] = pid  # fancy assignment, not put(): a third of the cost at these sizes

    def _commit_written(self, stripe: Stripe, pid: int, run: SlotIds, lane: int) -> None:
        stripe.journal.commit(OP_COMMIT, pid, run, stripe.words[H_FULL] + len(run), -1, lane, len(run))

    def give_back(self, pid: int, ids: npt.ArrayLike) -> int:
        """Return slots ``pid`` acquired and did not write (``writing`` -> ``empty``); returns how many it held."""
        mine = self._held(pid, ids, (WRITING,))
        for stripe, run in self._runs(mine):
            self._take(stripe)
            try:
                stripe.journal.commit(OP_GIVE_BACK, pid, run, -1, stripe.words[H_EMPTY] + len(run))
            finally:
                stripe.release()
        return len(mine)
