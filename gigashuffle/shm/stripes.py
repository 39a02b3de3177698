"""Stripes: a node's slot table split into ranges of slots, each with its own lock, journal, counts and lanes.

NOTE [ Stripes ]
One lock for the whole table makes its transitions serial, so a node's rate of small rows tops out at
1 / (lock time per row) whatever its cores (NOTE [ Node lock budget ] in shm/slottable.py). The table is split into
``S`` stripes of consecutive slots (``S`` fixed when the table is made: the loader's ``lock_stripes``, 1 unless
asked, since stripes cost CPU per row below the one lock's ceiling: docs/benchmarks.md; a table made without a
count gets ``default_stripes``); stripe ``k`` has its
own lock (NOTE [ Stripe locks ] in shm/nodelock.py), header (journal words, full and empty counts, rows written and
read, version clock, lock figures), journal (its range of the journal-id column) and lanes. An op that moves slots of
one stripe takes that stripe's lock only, so ``S`` of them run at once:
- a writer acquires in one stripe, chosen at random in proportion to its empty slots among the stripes with as many
  as it wants (else the one with most: ``choose``), and commits each run of its pending slots in its own stripe, in
  row order, one op each: its lane grows by each run's rows, so a death between two runs leaves the lane counting a
  prefix of its rows, as NOTE [ Respawned writers ] needs;
- a reader draws in one stripe, chosen in proportion to its full slots among those with at least the ``n`` wanted,
  and draws ``n`` uniformly from it: each slot of those stripes is drawn with probability ``n / (their full
  slots)``, as from one table. Its draws are sized to a stripe's share (reader.py), so a stripe short of ``n`` is
  rare; when none has ``n`` but the table does, the draw is a wide op (below). A release returns one draw's slots,
  so it is one stripe's op unless the draw was wide.
- versions: each stripe has its own clock; stripe ``k`` hands out ``clock * S + k``, unique over the table.
Wide ops take every stripe's lock, in stripe order (so two of them, or one and any one-stripe op, never deadlock:
a one-stripe op holds one lock at a time): repair, registering a holder, evict, a draw across stripes and its
release, ``stats``, ``full_ids`` and ``lane_values``. Those that move slots are journaled in the wide journal
(``WideJournal`` in shm/journal.py: the ids of any stripes, each stripe's new counts, one lane in stripe 0's lanes),
so a kill inside one is rolled forward whole: a one-stripe op that finds the wide journal pending after taking its
lock (its holder died holding every lock) lets go, takes every lock in order, which rolls it forward, and starts
again. A lane's value is the sum of its cells over the stripes, read under every lock (``lane_values``) or, as a
hint, without.
With one stripe (small tables) every op is the old node lock's, under the file's flock, and nothing is wide.
"""

from __future__ import annotations

import random
import time

from gigashuffle.config import MOST_STRIPES
from gigashuffle.shm.journal import H_EMPTY, H_FULL, H_HELD_NS, H_HOLDS, H_LENGTH, H_OWNER, Header, Journal
from gigashuffle.shm.nodelock import NodeLock
from gigashuffle.shm.nodelock import _pid as _this_pid  # kept current across fork by nodelock's hook
from gigashuffle.shm.picker import SlotPicker

STRIPE_SLOTS = 16384  # the least slots of a stripe that default_stripes makes: 16 batches of 1,024 rows


def default_stripes(slots: int) -> int:
    """The stripes of a table of ``slots`` slots: one per ``STRIPE_SLOTS``, at most ``MOST_STRIPES``."""
    return max(1, min(MOST_STRIPES, slots // STRIPE_SLOTS))


class WidePending(Exception):
    """A wide op's holder died inside it: every lock must be taken, in order, to roll it forward."""


class Stripe:
    """One stripe's views and this process's lock and searches in it: slots ``[lo, hi)``."""

    def __init__(
        self, k: int, lo: int, hi: int, header: Header, journal: Journal, lock: NodeLock, wide: memoryview,
        seed: int | None,
    ) -> None:  # fmt: skip
        self.k, self.lo, self.hi = k, lo, hi
        self.wide = wide  # the wide journal's header words (its length: a wide op pending)
        self.header, self.words, self.journal, self.lock = header, header.data, journal, lock
        self.picker = SlotPicker(hi - lo, None if seed is None else seed + k)
        self.held_since_ns = 0  # when this process last took the lock (one thread at a time holds it)

    def acquire(self, wait_s: float | None = None, wide: bool = False) -> None:
        """Take the lock, rolling forward an op its last holder died in. Unless the caller is taking every lock
        (``wide``), raise ``WidePending`` with the lock released if a wide op's holder died inside it."""
        self.lock.acquire(wait_s)
        try:
            self.held_since_ns = time.perf_counter_ns()
            self.words[H_OWNER] = _this_pid[0]
            if self.words[H_LENGTH]:
                self.journal.roll_forward()
            if not wide and self.wide[H_LENGTH]:
                raise WidePending
        except BaseException:
            self.lock.release()  # not release(): its figures are for transitions, and the table may be closed
            raise

    def release(self) -> None:
        # Statistics, not journaled: a holder killed here loses one hold's figures, nothing else; an exception
        # here (a table closed by another thread) must not keep the lock.
        try:
            self.words[H_OWNER] = 0
            header = self.header  # numpy stores: a header made read-only (a closed table's) raises here
            header[H_HELD_NS] += time.perf_counter_ns() - self.held_since_ns
            header[H_HOLDS] += 1
        finally:
            self.lock.release()

    def full(self) -> int:
        return int(self.words[H_FULL])

    def empty(self) -> int:
        return int(self.words[H_EMPTY])


def choose(rng: random.Random, counts: list[int], n: int) -> int:
    """A stripe at random in proportion to ``counts`` among those with at least ``n``; -1 if none has."""
    weights = [c if c >= n else 0 for c in counts]
    total = sum(weights)
    if total <= 0:
        return -1
    point = rng.randrange(total)
    for k, w in enumerate(weights):
        if point < w:
            return k
        point -= w
    return len(counts) - 1
