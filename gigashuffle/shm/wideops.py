"""The slot table's wide ops: those that take every stripe's lock, in stripe order (NOTE [ Stripes ] in
shm/stripes.py), and journal in the wide journal when they move slots of several stripes."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from gigashuffle.host.pids import process_start
from gigashuffle.shm.holders import REGISTRY_ROWS
from gigashuffle.shm.journal import H_EMPTY, OP_DRAW, OP_EVICT, OP_RELEASE_EVICT, OP_RELEASE_KEEP, OP_REPAIR
from gigashuffle.shm.picker import EMPTY, FULL, NO_IDS, READING, READING_EVICT, SlotIds, States
from gigashuffle.shm.slotmap import SlotMap
from gigashuffle.shm.stripes import Stripe, choose
from gigashuffle.shm.tablereadings import ShuffleBufferStats


class WideOps(SlotMap):
    """Repair, holder registration, evict, draws and releases across stripes, the readings under every lock, and
    the helpers every op uses: which slots a process holds, and which stripes slot ids lie in."""

    def _counts_locked(self) -> tuple[list[int], list[int]]:
        """Every stripe's full and empty counts (exact: under every lock)."""
        return [s.full() for s in self._stripes], [s.empty() for s in self._stripes]

    def _per_stripe(self, ids: SlotIds) -> npt.NDArray[np.intp]:
        """How many of ``ids`` lie in each stripe."""
        return np.bincount(ids // self.stripe_slots, minlength=self.stripes)

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

    # -- stripes ---------------------------------------------------------------------------------------------
    def _runs(self, ids: SlotIds) -> list[tuple[Stripe, SlotIds]]:
        """``ids`` cut into runs of one stripe each, in their order (a writer's commit: NOTE [ Stripes ])."""
        if not len(ids):
            return []
        if self.stripes == 1:
            return [(self._stripes[0], ids)]
        first = self._stripes[int(ids[0]) // self.stripe_slots]
        if first.lo <= ids.min() and ids.max() < first.hi:  # the usual case: one acquisition's slots
            return [(first, ids)]
        k = ids // self.stripe_slots
        cuts = np.flatnonzero(k[1:] != k[:-1]) + 1
        starts = [0, *cuts.tolist()]
        ends = [*cuts.tolist(), len(ids)]
        return [(self._stripes[int(k[a])], ids[a:b]) for a, b in zip(starts, ends, strict=True)]

    def _stripe_of(self, ids: SlotIds) -> Stripe | None:
        """The stripe of every one of ``ids`` (not empty), or None if they lie in several."""
        if self.stripes == 1:
            return self._stripes[0]
        stripe = self._stripes[int(ids[0]) // self.stripe_slots]
        return stripe if stripe.lo <= ids.min() and ids.max() < stripe.hi else None

    def _for_writer(self, n: int) -> Stripe:
        """The stripe a writer reserves ``n`` slots in: by empty slots (NOTE [ Stripes ])."""
        stripes = self._stripes
        if len(stripes) == 1:
            return stripes[0]
        empties = [s.words[H_EMPTY] for s in stripes]
        k = choose(self._random, empties, n)
        return stripes[k if k >= 0 else int(np.argmax(empties))]

    def _local(self, stripe: Stripe) -> States:
        return self.state[stripe.lo : stripe.hi]

    # -- readers across stripes ------------------------------------------------------------------------------
    def _draw_wide(self, pid: int, n: int, min_full: int) -> SlotIds:
        """``n`` uniformly random full slots of the whole table, when no stripe has ``n``: under every lock, one
        journaled op in the wide journal."""
        with self._locked():
            full, empty = self._counts_locked()
            total = sum(full)
            if total < max(n, min_full):
                return NO_IDS
            ids = self._picker.sample_full(self.state, n, total)
            taken = self._per_stripe(ids)
            self._wide.commit_wide(OP_DRAW, pid, ids, [f - int(t) for f, t in zip(full, taken, strict=True)], empty)
        return ids

    def _release_wide(self, pid: int, mine: SlotIds, evict: bool, lane: int, batches: int) -> None:
        """Release slots of several stripes (a wide draw's) in one op: the lane moves with all of them."""
        with self._locked():
            full, empty = self._counts_locked()
            moved = self._per_stripe(mine)
            back = np.zeros_like(moved) if evict else self._per_stripe(mine.compress(self.state.take(mine) == READING))
            full = [f + int(b) for f, b in zip(full, back, strict=True)]
            empty = [e + int(m) - int(b) for e, m, b in zip(empty, moved, back, strict=True)]
            op = OP_RELEASE_EVICT if evict else OP_RELEASE_KEEP
            self._wide.commit_wide(op, pid, mine, full, empty, lane, batches)

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
            gone = self._per_stripe(chosen.compress(self.state.take(chosen) == FULL))
            full, empty = self._counts_locked()
            full = [f - int(g) for f, g in zip(full, gone, strict=True)]
            empty = [e + int(g) for e, g in zip(empty, gone, strict=True)]
            self._wide.commit_wide(OP_EVICT, 0, chosen, full, empty)
        return len(chosen)

    # -- supervision -----------------------------------------------------------------------------------------
    def _register_once(self, pid: int) -> None:
        """Register ``pid`` before its first transition, under every lock (the registry is the table's)."""
        if pid not in self._holders.known:
            with self._locked():
                self._register(pid)

    def _register(self, pid: int) -> None:
        """Enter ``pid`` in the holder registry before a transition gives it slots; under every lock (NOTE [ Holder
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
            gone = self._holders.gone()  # again under the locks: a row may have been repaired or taken over
            if scan:
                alive = self._holders.alive()
                held = np.flatnonzero((self.state != EMPTY) & (self.state != FULL))
                gone = sorted(set(gone) | {p for p in np.unique(self.holder[held]).tolist() if p not in alive})
            repaired = self._repair_locked(gone)
            self._holders.forget(gone)  # after the repair's commit: a kill in between leaves a row to repair again
        return repaired

    def _repair_locked(self, pids: list[int]) -> int:
        """Return the slots held under ``pids`` (gone processes): one compare over the holder column, one op in
        the wide journal."""
        if not pids:
            return 0
        hit = self.holder == pids[0] if len(pids) == 1 else np.isin(self.holder, pids)
        candidates = np.flatnonzero(hit)
        now = self.state.take(candidates)
        ids = candidates.compress((now != EMPTY) & (now != FULL))
        moved = self._per_stripe(ids)
        back = self._per_stripe(ids.compress(self.state.take(ids) == READING))
        full, empty = self._counts_locked()  # writing and reading-then-evict slots become empty, reading ones full
        full = [f + int(b) for f, b in zip(full, back, strict=True)]
        empty = [e + int(m) - int(b) for e, m, b in zip(empty, moved, back, strict=True)]
        self._wide.commit_wide(OP_REPAIR, 0, ids, full, empty)
        return len(ids)

    def stats(self, wait_s: float | None = None) -> ShuffleBufferStats:
        """The slot counts at one moment: the headers' counts read under every lock, which every transition keeps
        exact (journaled with it), so this costs the same for any table size."""
        with self._locked(wait_s):
            return self.counts()[2]  # under the locks no transition is half done: the counts agree

    def full_ids(self, wait_s: float | None = None) -> SlotIds:
        """The slots that are full right now (a checkpoint's copy of the buffer: NOTE [ Checkpoint cut ])."""
        with self._locked(wait_s):
            return np.flatnonzero(self.state == FULL)
