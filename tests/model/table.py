"""A model of the slot table (gigashuffle/shm/slottable.py, shm/journal.py, shm/lanes.py) as an immutable value.

Each function is one journaled transition of the real table under its node lock, so it is atomic here as there.
Line by line against the real code:

* ``acquire`` = ``SlotTable.acquire_empty`` (slottable.py:120-132): up to ``n`` empty slots become ``writing``
  under ``pid``. The real picker scans from where this process's last search stopped (shm/picker.py); the model
  takes the lowest empty ids. Slot ids only name places, so this picks one of the real table's possible answers.
* ``commit`` = ``commit_written`` (slottable.py:134-143): the slots ``pid`` holds ``writing`` become ``full``; the
  lane grows by their count in the same op (journal.py:89-90, 126-128). The writer asserts it held all of them
  (``PendingRows._check``, procs/pending.py:151-153): here a ``ModelError``.
* ``commit_acquire`` = ``commit_and_acquire`` (slottable.py:145-168): commit, then ``n`` empty slots if
  ``0 < n <= empty`` and ``full + empty - n >= min_full``, else none (all or nothing).
* ``give_back`` = ``give_back`` (slottable.py:183-191): ``writing`` -> ``empty``.
* ``draw`` = ``draw_full`` (slottable.py:194-213): none while ``full < max(n, min_full)``; else ``n`` full slots
  become ``reading``. The real draw is uniform at random (picker.sample_full); the model takes the lowest full ids.
  (Divergence: an interleaving that needs one particular random draw is only explored if it is the lowest.)
* ``release`` = ``release_read``/``release_and_draw`` with ``evict=True`` (slottable.py:222-262): ``reading`` ->
  ``empty``, the read counter (``H_READ``, journal.py:93-94, 119-121) grows by the slots and the reader's lane by
  ``batches``. ``release_and_draw`` is ``release`` then ``draw`` in one step of the caller.
* ``repair`` = ``_repair_locked`` for one dead pid (slottable.py:321-332): its ``writing`` slots become empty, its
  ``reading`` ones full again (journal.py:143-145).
* ``full_ids`` = ``full_ids`` (slottable.py:343-346).
Not modelled: ``reading-then-evict`` (only ``evict()`` makes it; checkpoints run with evict_on_read and no evict),
versions and the writer pid column (figures only), the holder registry (a pid here is never reused).
``row`` is the buffer beside the table (shm/buffer.py): the row id a slot's bytes hold, written by the writer into
a slot it holds ``writing`` and left as it is by every transition, as the real bytes are.
tests/unit/test_cut_explorer.py checks these functions against the real ``SlotTable`` op by op.
"""

from __future__ import annotations

from typing import NamedTuple

EMPTY, WRITING, FULL, READING = 0, 1, 2, 3
Row = tuple[int, int, int]  # (rank, writer index or -1 for a row a checkpoint saved, row number)
Ids = tuple[int, ...]


class ModelError(AssertionError):
    """An assertion of the real code (or of the model) failed in an explored interleaving."""


class Table(NamedTuple):
    state: tuple[int, ...]
    holder: tuple[int, ...]
    row: tuple[Row | None, ...]
    lanes: tuple[int, ...]
    read: int = 0  # H_READ: slots released by readers (the first mix lifts once it is above zero)
    # The ``origin`` column (NOTE [ Positions checkpoint ]): lane << LANE_SHIFT | stream row, -1 for none (a saved
    # row put back), stamped by the writer while it holds the slot ``writing``, like the row's bytes.
    origin: tuple[int, ...] = ()

    @staticmethod
    def new(slots: int, lanes: int) -> Table:
        return Table((EMPTY,) * slots, (0,) * slots, (None,) * slots, (0,) * lanes, 0, (-1,) * slots)

    def count(self, state: int) -> int:
        return self.state.count(state)

    def _set(self, ids: Ids, state: int, holder: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        states, holders = list(self.state), list(self.holder)
        for i in ids:
            states[i], holders[i] = state, holder
        return tuple(states), tuple(holders)

    def _held(self, pid: int, ids: Ids, state: int) -> Ids:
        return tuple(i for i in ids if self.state[i] == state and self.holder[i] == pid)

    def _lane(self, lane: int, step: int) -> tuple[int, ...]:
        if lane < 0 or not step:
            return self.lanes
        lanes = list(self.lanes)
        lanes[lane] += step
        return tuple(lanes)


def acquire(t: Table, pid: int, n: int) -> tuple[Table, Ids]:
    ids = tuple(i for i, s in enumerate(t.state) if s == EMPTY)[: max(0, n)]
    state, holder = t._set(ids, WRITING, pid)
    return t._replace(state=state, holder=holder), ids


def commit(t: Table, pid: int, ids: Ids, lane: int) -> Table:
    mine = t._held(pid, ids, WRITING)
    if len(mine) != len(ids):
        raise ModelError(f"writer {pid} lost slots it was writing: {ids} (held {mine})")
    if not ids:
        return t
    state, holder = t._set(ids, FULL, pid)
    return t._replace(state=state, holder=holder, lanes=t._lane(lane, len(ids)))


def commit_acquire(t: Table, pid: int, ids: Ids, n: int, min_full: int, lane: int) -> tuple[Table, Ids]:
    t = commit(t, pid, ids, lane)
    empty, full = t.count(EMPTY), t.count(FULL)
    if 0 < n <= empty and full + empty - n >= min_full:
        return acquire(t, pid, n)
    return t, ()


def give_back(t: Table, pid: int, ids: Ids) -> Table:
    mine = t._held(pid, ids, WRITING)
    state, holder = t._set(mine, EMPTY, pid)
    return t._replace(state=state, holder=holder)


def draw(t: Table, pid: int, n: int, min_full: int) -> tuple[Table, Ids]:
    full = t.count(FULL)
    if n <= 0 or full < max(n, min_full):
        return t, ()
    ids = tuple(i for i, s in enumerate(t.state) if s == FULL)[:n]
    state, holder = t._set(ids, READING, pid)
    return t._replace(state=state, holder=holder), ids


def release(t: Table, pid: int, ids: Ids, lane: int, batches: int) -> Table:
    mine = t._held(pid, ids, READING)
    if len(mine) != len(ids):
        raise ModelError(f"reader {pid} lost slots it was reading: {ids} (held {mine})")
    state, holder = t._set(ids, EMPTY, pid)
    return t._replace(state=state, holder=holder, lanes=t._lane(lane, batches), read=t.read + len(ids))


def repair(t: Table, pid: int) -> Table:
    states, holders = list(t.state), list(t.holder)
    for i, (s, h) in enumerate(zip(t.state, t.holder, strict=True)):
        if h == pid and s == WRITING:
            states[i] = EMPTY
        elif h == pid and s == READING:
            states[i] = FULL
    return t._replace(state=tuple(states), holder=tuple(holders))


def full_ids(t: Table) -> Ids:
    return tuple(i for i, s in enumerate(t.state) if s == FULL)


def write_rows(t: Table, pid: int, ids: Ids, rows: tuple[Row, ...], origins: tuple[int, ...] | None = None) -> Table:
    """``SlotBuffer.write`` into slots the writer holds (procs/writecycle.py ``write``): the bytes change, the state
    not; with ``origins``, ``Track.stamp`` too (the positions way; in the saved way the column is left as it was)."""
    if t._held(pid, ids, WRITING) != ids:
        raise ModelError(f"writer {pid} copies into slots it does not hold: {ids}")
    row = list(t.row)
    for i, r in zip(ids, rows, strict=True):
        row[i] = r
    if origins is None:
        return t._replace(row=tuple(row))
    origin = list(t.origin)
    for i, o in zip(ids, origins, strict=True):
        origin[i] = o
    return t._replace(row=tuple(row), origin=tuple(origin))
