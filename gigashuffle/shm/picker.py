"""Which slots a transition takes: the empty ones a writer fills next, the full ones a reader draws.

Both searches read the shared ``state`` array a few times per chunk and batch, so neither sorts nor passes over the
whole table in the usual case. Both run before the node lock is taken, on states that may change meanwhile, and
the transition checks their result under it (NOTE [ Node lock budget ] in shm/slottable.py): a writer's search
for empty slots, and a reader's random candidates. What they keep between calls (a cursor, a random generator, a
scratch array) is private to the process.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

SlotIds = npt.NDArray[np.intp]  # numpy's own index type: a take or put with int32 ids converts them first
States = npt.NDArray[np.uint8]

EMPTY, WRITING, FULL, READING, READING_EVICT = 0, 1, 2, 3, 4
NO_IDS: SlotIds = np.empty(0, dtype=np.intp)
_SCAN_BELOW = 0.25  # below this fraction of full slots, draw from the list of full slots instead of rejecting
_MAX_ROUNDS = 16  # rejection rounds before a draw lists the full slots instead (one is the rule; see sample_full)


class SlotPicker:
    """One process's searches over a slot table of ``slots`` slots."""

    def __init__(self, slots: int, seed: int | None = None) -> None:
        self.slots = slots
        self._rng = np.random.default_rng(seed)
        self._seen: npt.NDArray[np.int32] | None = None  # sample_full's scratch
        self._cursor = 0  # where the next search for empty slots starts (first_empty)
        if not 0 < slots < 2**31:
            raise ValueError(f"a slot table holds 1 to 2**31 - 1 slots, got slots={slots}")
        self._reject_below = np.uint64(2**32 % slots)  # see _uniform_ids

    @property
    def cursor(self) -> int:
        """Where the next search for empty slots starts: a caller that discards a search's result (its slots were
        taken meanwhile) sets it back, so that the search it makes instead starts where the discarded one did."""
        return self._cursor

    @cursor.setter
    def cursor(self, value: int) -> None:
        self._cursor = value

    def first_empty(self, state: States, empty: int, n: int) -> SlotIds:
        """Up to ``n`` of the ``empty`` empty slots, the first found scanning forward from where the last search
        stopped (and wrapping around)."""
        # Readers empty slots uniformly at random while a writer fills the ones after its cursor, so the slots
        # just ahead of the cursor are the ones emptied longest ago. The header counts the empty slots: none
        # means no scan at all (a writer waiting on a full buffer polls this), and the scan stops once it has
        # every one there is. The first window is sized to hold n empty slots at the table's average density of
        # empty slots: just ahead of the cursor the density is higher (those slots were read longest), so one
        # window usually holds them (1.2 numpy calls per 4096-slot acquire at 1/8 empty, measured, the extra
        # ones at the wrap-around; half that window took 2), and each further window doubles: a table near
        # min_mixing (about half full) is found in one numpy call instead of the pass over the rest of the table
        # that a fixed-size first window fell back to whenever it came up short. From an empty table this fills
        # slots in order.
        slots = self.slots
        n = min(n, empty)
        if n <= 0:
            return NO_IDS
        window = min(slots, n * slots // empty + 256)
        start = self._cursor % slots
        lo, end, wrapped = start, slots, start == 0
        found: list[npt.NDArray[np.intp]] = []
        got = 0
        while got < n:
            if lo >= end:
                if wrapped:
                    break
                lo, end, wrapped = 0, start, True
                continue
            hi = min(end, lo + window)
            part = np.flatnonzero(state[lo:hi] == EMPTY)
            if len(part):
                found.append(part + lo if lo else part)
                got += len(part)
            lo, window = hi, 2 * window
        if not found:
            return NO_IDS
        ids: SlotIds = (found[0] if len(found) == 1 else np.concatenate(found))[:n]
        self._cursor = int(ids[-1]) + 1
        return ids

    def candidates(self, n: int, full: int, min_full: int = 0, state: States | None = None) -> SlotIds:
        """Distinct uniformly random slot ids in random order, as many as hold ``n`` of ``full`` full slots on
        average; none where the draw would take nothing (fewer than ``max(n, min_full)`` full: a reader polling a
        buffer that is still filling) or would list the full slots instead. Drawn before the node lock is taken
        (NOTE [ Node lock budget ] in shm/slottable.py): ``full`` is the header's count read without it, and
        ``sample_full`` checks the candidates' states under it, drawing more if they fall short. With ``state``,
        only the ones full in it now are kept (in their order), so that under the lock the first ``n`` are
        usually all still full and one check of their states is all the draw does there."""
        if n <= 0 or full < max(n, min_full, _SCAN_BELOW * self.slots):
            return NO_IDS
        ids = self._distinct(self._uniform_ids(self._draws_for(n, full, full)))
        if state is None:
            return ids
        kept: SlotIds = ids.compress(state.take(ids) == FULL)
        return kept

    def _distinct(self, ids: SlotIds) -> SlotIds:
        """``ids`` without repeats, in their order. Which copy of a repeat survives depends only on positions in
        ``ids``, never on slot ids, so random ids stay a uniform random sequence. Repeats are found with a scratch
        array (the last position written per slot) instead of np.unique, which sorts."""
        if self._seen is None:
            self._seen = np.zeros(self.slots, dtype=np.int32)
        positions = np.arange(len(ids), dtype=np.int32)
        self._seen[ids] = positions
        kept: SlotIds = ids.compress(self._seen.take(ids) == positions)
        return kept

    def sample_full(self, state: States, n: int, full: int, candidates: SlotIds = NO_IDS) -> SlotIds:
        """``n`` uniformly random slots of the ``full`` full ones (``full >= n``), taken first from ``candidates``
        (from ``candidates()``)."""
        if full < _SCAN_BELOW * self.slots:
            return self._listed_full(state, n, full)
        # Rejection sampling: draw slot ids uniformly, keep the full ones, drop repeats, take the first n. The
        # survivors of repeats form a uniform random sequence (``_distinct``), so the first n full ones are a
        # uniform random subset of the full slots. Each round draws for the hits that are expected to hold as many
        # distinct slots as are still wanted, plus 5% (``_draws_for``): one round per draw at 1/2 to 1/1 full for
        # 1,024 to 8,192 slots of 65,536, measured; drawing a fixed 1.25x the wanted ones took 3 rounds for 8,192
        # slots at 1/2 full, and each round re-checks the ones taken. The first round is usually ``candidates``,
        # drawn, freed of repeats and (from a reader) kept only where full before the lock was taken: here the
        # first n are checked, and if one of them is no longer full, the rest of the candidates in their order.
        # Either way the draw is the first n candidates full now, a uniform random sequence's; a slot that became
        # full since the candidates were checked (a commit meanwhile) waits for the next draw, like one
        # committed a moment after this draw.
        taken = NO_IDS
        if len(candidates):
            head = candidates[:n]
            ok = state.take(head) == FULL
            if len(head) == n and np.count_nonzero(ok) == n:  # count_nonzero: a fifth of ok.all()'s call cost
                return head
            taken = head.compress(ok)
            rest = candidates[n:]
            if len(rest):
                taken = np.concatenate([taken, rest.compress(state.take(rest) == FULL)])[:n]
        rounds = 0
        while len(taken) < n:
            rounds += 1
            if rounds > _MAX_ROUNDS:  # one round is the rule: a count of full slots that is wrong must not spin
                return self._listed_full(state, n, full)
            tries = self._uniform_ids(self._draws_for(n - len(taken), full - len(taken), full))
            hits = tries.compress(state.take(tries) == FULL)
            taken = self._distinct(np.concatenate([taken, hits]) if len(taken) else hits)[:n]
        return taken

    def _listed_full(self, state: States, n: int, full: int) -> SlotIds:
        """``n`` of the slots listed full by a pass over ``state``; an error naming the counts if fewer are."""
        listed = np.flatnonzero(state == FULL)
        if len(listed) < n:
            raise AssertionError(
                f"the slot table counts {full} full slots but {len(listed)} are full, fewer than the {n} drawn: "
                "its header no longer matches its states (a transition ran on slots it did not hold)"
            )
        chosen: SlotIds = self._rng.choice(listed, n, replace=False)
        return chosen

    def _draws_for(self, wanted: int, untaken: int, full: int) -> int:
        """Random slot ids to draw for ``wanted`` more distinct full slots of the ``untaken`` full ones not taken
        yet: ``h`` hits on untaken slots hold ``untaken * (1 - exp(-h / untaken))`` distinct ones on average, and
        a draw hits an untaken slot with probability ``untaken / slots``."""
        untaken = max(untaken, 1)  # sample_full draws only while fewer than n <= full are taken
        # Wanting every one of them is a coupon collector's count: about ln(untaken) + 1 times as many hits.
        every = wanted >= untaken
        hits = untaken * (math.log(untaken) + 1.0) if every else -untaken * math.log1p(-wanted / untaken)
        return int(hits * self.slots / untaken * 1.05) + 32

    def _uniform_ids(self, count: int) -> SlotIds:
        """About ``count`` slot ids, each uniformly random in ``[0, slots)`` and independent of the others.

        From raw 32-bit words by multiply-and-shift (Lemire's method): ``word * slots >> 32`` is uniform once the
        words whose low product half falls below ``2**32 % slots`` are dropped (none for a power-of-two table, at
        most ``slots / 2**32`` of them otherwise). Four times cheaper than scaling ``Generator.random()``, which
        builds a double per id; ``integers()`` costs as much as ``random()``.
        """
        words = self._rng.bit_generator.random_raw((count + 1) // 2).view(np.uint32)
        products = words.astype(np.uint64)
        products *= np.uint64(self.slots)
        if self._reject_below:
            products = products.compress((products & np.uint64(0xFFFFFFFF)) >= self._reject_below)
        products >>= np.uint64(32)
        ids: SlotIds = products.view(np.intp)  # every id < slots < 2**31: the same bits as int64
        return ids
