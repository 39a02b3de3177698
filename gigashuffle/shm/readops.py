"""The slot table's readers' ops: draws of uniformly random full slots, one stripe at a time, and their releases
(NOTE [ Stripes ] in shm/stripes.py; NOTE [ Node lock budget ] in shm/slottable.py)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from gigashuffle.shm.journal import H_EMPTY, H_FULL, OP_DRAW, OP_RELEASE_EVICT, OP_RELEASE_KEEP
from gigashuffle.shm.lanes import NO_LANE
from gigashuffle.shm.picker import NO_IDS, READING, READING_EVICT, SlotIds
from gigashuffle.shm.slotmap import Versions
from gigashuffle.shm.stripes import Stripe, choose
from gigashuffle.shm.wideops import WideOps

_NO_VERSIONS: Versions = np.empty(0, dtype=np.int64)
_RETRY = None  # _draw_in: the stripe chosen had fewer than n full slots by the time its lock was taken


class ReadOps(WideOps):
    """Draws and releases."""

    # -- readers ---------------------------------------------------------------------------------------------
    def draw_full(self, pid: int, n: int, min_full: int = 0) -> tuple[SlotIds, Versions]:
        """``n`` uniformly random full slots, now ``reading`` under ``pid``, with their versions; none while fewer
        than ``max(n, min_full)`` slots are full."""
        ids = self._draw(pid, n, min_full, None)
        return ids, self._versions_of_drawn(ids)

    def _draw(self, pid: int, n: int, min_full: int, released: Stripe | None, mine: SlotIds = NO_IDS,
              evict: bool = False, lane: int = NO_LANE, batches: int = 0) -> SlotIds:  # fmt: skip
        """A draw of ``n`` in one stripe chosen by full slots (NOTE [ Stripes ]), or a wide one when no stripe has
        ``n``; with ``released``, first the release of ``mine`` in that stripe, under the same hold when the draw's
        stripe is the same (else a hold of its own, before the draw)."""
        stripes = self._stripes
        for _ in range(4):
            fulls = [s.words[H_FULL] for s in stripes]
            total = sum(fulls)
            k, stripe = -1, None
            if n > 0 and total >= max(n, min_full):
                self._register_once(pid)
                k = 0 if len(stripes) == 1 else choose(self._random, fulls, n)
                stripe = stripes[k] if k >= 0 else None
            if released is not None and released is not stripe:
                self._take(released)
                try:
                    self._release_read(released, pid, mine, evict, lane, batches)
                finally:
                    released.release()
                released = None
            if stripe is None:
                return NO_IDS if n <= 0 or total < max(n, min_full) else self._draw_wide(pid, n, min_full)
            local = self._local(stripe)
            candidates = stripe.picker.candidates(n, fulls[k], 0, local)
            self._take(stripe)
            try:
                if released is not None:
                    self._release_read(stripe, pid, mine, evict, lane, batches)
                    released = None
                ids = self._draw_in(stripe, pid, n, min_full, candidates)
            finally:
                stripe.release()
            if ids is not _RETRY:
                return ids
        return NO_IDS

    def _draw_in(self, stripe: Stripe, pid: int, n: int, min_full: int, candidates: SlotIds) -> SlotIds | None:
        """Under the stripe's lock: ``n`` of its full slots (table ids), NO_IDS if the table has fewer than
        ``max(n, min_full)`` full, ``_RETRY`` if the stripe has fewer than ``n``."""
        full = stripe.words[H_FULL]
        if full < n:
            return _RETRY
        if (full if self.stripes == 1 else sum(s.words[H_FULL] for s in self._stripes)) < max(n, min_full):
            return NO_IDS
        ids = stripe.picker.sample_full(self._local(stripe), n, full, candidates)
        if stripe.lo:
            ids = ids + stripe.lo
        stripe.journal.commit(OP_DRAW, pid, ids, full - n)
        return ids

    def _versions_of_drawn(self, ids: SlotIds) -> Versions:
        # Read after the lock is released: a slot reading under this process keeps its version (only the writer
        # that reserved a slot sets one; evict and repair change states, never versions), and a random gather of
        # 8-byte words is one of the costlier steps of a draw that every process of the node waits for
        # (NOTE [ Node lock budget ]).
        return self.version[ids] if len(ids) else _NO_VERSIONS

    def release_read(self, pid: int, ids: npt.ArrayLike, evict: bool, lane: int = NO_LANE, batches: int = 0) -> int:
        """Return slots ``pid`` read: to empty if ``evict`` (or evict() marked them), else to full. ``lane`` grows by
        ``batches`` (NOTE [ Lanes ] in shm/lanes.py), in the one op that releases them all (a wide one if they lie
        in several stripes: NOTE [ Stripes ])."""
        mine = self._held(pid, ids, (READING, READING_EVICT))
        if len(mine):
            stripe = self._stripe_of(mine)
            if stripe is None:
                self._release_wide(pid, mine, evict, lane, batches)
            else:
                self._take(stripe)
                try:
                    self._release_read(stripe, pid, mine, evict, lane, batches)
                finally:
                    stripe.release()
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
        """``release_read`` then ``draw_full``, under one hold of the lock when the draw is in the released slots'
        stripe (two journaled ops): a reader with a free ring slot takes its next batch as it returns the last.
        Returns how many it still held, and the draw."""
        mine = self._held(pid, ids, (READING, READING_EVICT))
        stripe = self._stripe_of(mine) if len(mine) else None
        if len(mine) and stripe is None:
            self._release_wide(pid, mine, evict, lane, batches)
        drawn = self._draw(pid, n, min_full, stripe, mine, evict, lane, batches)
        return len(mine), drawn, self._versions_of_drawn(drawn)

    def _release_read(self, stripe: Stripe, pid: int, mine: SlotIds, evict: bool, lane: int, batches: int) -> None:
        words = stripe.words
        empty = words[H_EMPTY]
        if evict:
            stripe.journal.commit(OP_RELEASE_EVICT, pid, mine, -1, empty + len(mine), lane, batches)
        else:  # slots evict() marked meanwhile become empty, the others full again
            back = int(np.count_nonzero(self.state.take(mine) == READING))
            full = words[H_FULL] + back
            stripe.journal.commit(OP_RELEASE_KEEP, pid, mine, full, empty + len(mine) - back, lane, batches)
