"""The slot table's header and journal: how a transition survives its holder's death at any instruction.

NOTE [ Slot journal ]
Why a kill at any instruction loses no slot and blocks nobody (NOTE [ Slot table ] in shm/slottable.py says what the
table holds):
- Each transition is journaled. The holder writes the op, its pid and the slot ids into the journal region, then
  stores the journal length (one aligned 8-byte store: the commit point), applies the op, and stores length 0.
  Killed before the commit point: the table is untouched. Killed after it: the next process to take the lock
  finds a nonzero length and applies the op again before doing anything else (roll forward).
- Re-applying an op is idempotent, because every op either sets a value that does not depend on the old one
  (holder, state of ids chosen under the lock, counts and the version clock taken from the journal rather than
  incremented) or moves only slots still in the op's source state (``reading -> full`` skips a slot already
  moved).
- A process that dies while holding slots but not the lock leaves them ``writing`` or ``reading`` under its pid:
  ``repair()`` (run by the supervisor when it learns of a death, and about once a second in each child, finding
  the dead through the holder registry: NOTE [ Holder registry ] in shm/holders.py) returns
  a dead writer's slots to empty (rows may be torn), a dead reader's to full (never announced: see NOTE
  [ Reader cycle ]), or to empty when evict() marked them meanwhile. Repair is journaled like any other op.
- Four counts live in the header: full slots (read by every draw, so that no draw passes over the whole table),
  empty slots (read by every acquire, so that a writer waiting on a full buffer scans nothing), and the totals of
  rows written and read (for ``gigashuffle stats``). An op journals each count's new value, computed under the
  lock before the commit point, and applying the op sets that value: a roll-forward cannot count twice. So does
  the version clock, which an acquire moves past the versions it allots.
- A commit or a release may move a lane too (NOTE [ Lanes ] in shm/lanes.py): the op journals the lane and its new
  value, and applying the op sets it, so a process's count of its rows or batches moves with them, atomically.
- A table in stripes (NOTE [ Stripes ] in shm/stripes.py) has one such journal, header and set of counts and lanes
  per stripe, each under its stripe's lock, and one more, the wide journal, for the ops that hold every lock and
  move slots of several stripes: it journals every stripe's new counts with the ids (``WideJournal``).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from gigashuffle.shm.picker import EMPTY, FULL, READING, READING_EVICT, WRITING, SlotIds

HEADER_BYTES = 256  # 32 int64 words, indexed by the H_* names below
# Words: magic, slots, journal length (the commit point), op, pid; the version clock, rows written, rows read, the
# journaled new value of the counter the op moves (rows written or read, or the clock), full slots and their
# journaled new count, empty slots and theirs; the node lock's total hold time (ns) and number of holds, which are
# statistics and not journaled (NOTE [ Node lock budget ] in shm/slottable.py); the creator's pid namespace (NOTE
# [ Holder registry ] in shm/holders.py); the lane an op moves and the lane's journaled new value (NOTE [ Lanes ] in
# shm/lanes.py).
H_MAGIC, H_SLOTS, H_LENGTH, H_OP, H_PID = 0, 1, 2, 3, 4
H_CLOCK, H_WRITTEN, H_READ, H_JCOUNT, H_FULL, H_JFULL, H_EMPTY, H_JEMPTY = 5, 6, 7, 8, 9, 10, 11, 12
H_HELD_NS, H_HOLDS, H_PIDNS = 13, 14, 15
H_LANE, H_JLANE = 16, 17
# Stripes (NOTE [ Stripes ] in shm/stripes.py): the pid holding the stripe's lock (NOTE [ Stripe locks ] in
# shm/nodelock.py), and in stripe 0's header, which is also the table's, the number of stripes.
H_OWNER, H_STRIPES = 18, 19
MAX_STRIPES = 64
WIDE_BYTES = HEADER_BYTES + 16 * MAX_STRIPES  # the wide journal's header, then each stripe's journaled counts

OP_ACQUIRE, OP_COMMIT, OP_DRAW, OP_RELEASE_KEEP, OP_RELEASE_EVICT, OP_EVICT, OP_REPAIR, OP_GIVE_BACK = range(1, 9)

Header = npt.NDArray[np.int64]


class Journal:
    """Journals and applies the ops of one slot table, over views of its header, journal ids, states and holders.
    Every method runs under the node lock."""

    def __init__(
        self,
        header: Header,
        ids: npt.NDArray[np.int32],
        state: npt.NDArray[np.uint8],
        holder: npt.NDArray[np.int32],
        lanes: Header,
    ) -> None:
        self.header, self.ids, self.state, self.holder, self.lanes = header, ids, state, holder, lanes
        # The same words as Python memoryviews, for the stores of an op: a memoryview item is a third of the cost
        # of a numpy scalar store or read (about 20 against 60-90 ns), and an op makes about fifteen of them under
        # the node lock. Each is still one aligned 8-byte store (CPython packs an int64 item with one fixed-size
        # memcpy), so the commit point keeps its meaning.
        self.words, self.lane_words = header.data, lanes.data

    def commit(
        self,
        op: int,
        pid: int,
        ids: SlotIds,
        full_after: int = -1,
        empty_after: int = -1,
        lane: int = -1,
        step: int = 0,
    ) -> None:
        """Journal the op, apply it, clear the journal. ``full_after`` and ``empty_after``: the counts of full and
        of empty slots once it is applied (-1: the op moves no slot into or out of that state). ``lane``: the lane
        that grows by ``step`` with the op (NOTE [ Lanes ] in shm/lanes.py), journaled as its new value."""
        n = len(ids)
        if n == 0:
            return
        self.ids[:n] = ids
        words = self.words
        words[H_OP] = op
        words[H_PID] = pid
        words[H_LANE] = lane
        if lane >= 0:
            words[H_JLANE] = self.lane_words[lane] + step
        if op == OP_COMMIT:  # counters are journaled as their new value, so a roll-forward sets them again
            words[H_JCOUNT] = words[H_WRITTEN] + n
        elif op == OP_ACQUIRE:  # so is the version clock, moved past a fresh version for each slot reserved
            words[H_JCOUNT] = words[H_CLOCK] + n
        elif op in (OP_RELEASE_KEEP, OP_RELEASE_EVICT):
            words[H_JCOUNT] = words[H_READ] + n
        words[H_JFULL] = words[H_FULL] if full_after < 0 else full_after
        words[H_JEMPTY] = words[H_EMPTY] if empty_after < 0 else empty_after
        words[H_LENGTH] = n  # the commit point: from here on the op happens, even if we die
        self.apply(op, pid, ids)
        words[H_LENGTH] = 0

    def roll_forward(self) -> None:
        words = self.words
        n, op, pid = words[H_LENGTH], words[H_OP], words[H_PID]
        self.apply(op, pid, self.ids[:n].astype(np.intp))
        words[H_LENGTH] = 0

    def apply(self, op: int, pid: int, ids: SlotIds) -> None:
        # A roll-forward finds every journaled slot either as the op found it or as the op left it (nothing else
        # runs between a death and the next lock holder's roll-forward): ops whose ids were all in one state when
        # journaled set their target state outright; the others move only slots still in a source state.
        state, words = self.state, self.words
        if op in (OP_ACQUIRE, OP_DRAW):
            self.holder[ids] = pid
            state[ids] = WRITING if op == OP_ACQUIRE else READING
            if op == OP_ACQUIRE:
                words[H_CLOCK] = words[H_JCOUNT]
        elif op == OP_COMMIT:  # every id was writing under pid, and carries the version its writer stamped
            state[ids] = FULL
            words[H_WRITTEN] = words[H_JCOUNT]
        elif op == OP_RELEASE_EVICT:  # every id was reading (or reading-then-evict) under pid
            state[ids] = EMPTY
            words[H_READ] = words[H_JCOUNT]
        elif op == OP_GIVE_BACK:  # every id was writing under pid (reserved, not written)
            state[ids] = EMPTY
        else:
            self._apply_by_state(op, ids)
        lane = words[H_LANE]
        if lane >= 0:
            self.lane_words[lane] = words[H_JLANE]
        words[H_FULL] = words[H_JFULL]
        words[H_EMPTY] = words[H_JEMPTY]

    def _apply_by_state(self, op: int, ids: SlotIds) -> None:
        """The ops whose slots may be in several states: each moves only the slots still in a source state."""
        state = self.state
        old = state.take(ids)
        if op == OP_RELEASE_KEEP:
            state[ids.compress(old == READING)] = FULL
            state[ids.compress(old == READING_EVICT)] = EMPTY
            self.words[H_READ] = self.words[H_JCOUNT]
        elif op == OP_EVICT:
            state[ids.compress(old == FULL)] = EMPTY
            state[ids.compress(old == READING)] = READING_EVICT
        elif op == OP_REPAIR:
            state[ids.compress((old == WRITING) | (old == READING_EVICT))] = EMPTY
            state[ids.compress(old == READING)] = FULL
        else:
            raise AssertionError(f"unknown slot table op {op} in the journal")


class WideJournal(Journal):
    """The journal of the ops that take every stripe's lock and move slots of several stripes (NOTE [ Stripes ] in
    shm/stripes.py): the same protocol over a header of its own, with each stripe's new full and empty counts
    journaled after it and set by ``apply``. Its own rows-read counter counts the slots its releases move."""

    def __init__(self, header: Header, counts: Header, stripe_words: list[memoryview], ids: npt.NDArray[np.int32],
                 state: npt.NDArray[np.uint8], holder: npt.NDArray[np.int32], lanes: Header) -> None:  # fmt: skip
        super().__init__(header, ids, state, holder, lanes)
        self.counts = counts.data  # per stripe: new full count, new empty count
        self.stripe_words = stripe_words

    def commit_wide(
        self, op: int, pid: int, ids: SlotIds, full: list[int], empty: list[int], lane: int = -1, step: int = 0
    ) -> None:
        """Journal ``op`` on ``ids`` (of any stripes) with every stripe's counts once it is applied, apply it."""
        if len(ids) == 0:
            return
        counts = self.counts
        for k, (f, e) in enumerate(zip(full, empty, strict=True)):
            counts[2 * k], counts[2 * k + 1] = f, e
        self.commit(op, pid, ids, -1, -1, lane, step)

    def apply(self, op: int, pid: int, ids: SlotIds) -> None:
        super().apply(op, pid, ids)
        counts = self.counts
        for k, words in enumerate(self.stripe_words):
            words[H_FULL], words[H_EMPTY] = counts[2 * k], counts[2 * k + 1]
