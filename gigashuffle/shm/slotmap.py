"""The slot table's memory: its layout in the memfd, the views over it, the node lock around a transition, and
``counts()``, which ``stats()`` reads under every lock (the other readings are in shm/tablereadings.py, the
transitions in shm/slottable.py: NOTE [ Slot table ] there).

Layout: stripe 0's header, which is also the table's (magic, slots, stripes, pid namespace; counts, clock, lock
figures, journal: shm/journal.py), the wide journal's header and counts, the headers of stripes 1 to S-1 (NOTE
[ Stripes ] in shm/stripes.py), the holder registry (shm/holders.py), each stripe's lanes (shm/lanes.py), then per
slot its ``version`` (int64) and ``origin`` (int64: where the row came from, stamped by its writer outside the lock
for checkpoints by positions, NOTE [ Positions checkpoint ] in checkpoint/positions.py; -1 unknown) side by side,
``holder`` (int32), the stripe journals' id column (int32; stripe k journals in its own range of it), the wide
journal's (int32), ``writer`` (int32) and ``state`` (uint8).

NOTE [ Version and origin ]
A slot's version and origin share one 16-byte record, so one cache line holds both. Slots are touched in random
order, so each column costs a cache miss per row wherever it is read or written: the writer stamps a reserved
slot's version and, checkpointing by positions, its origin a little later; the reader reads the version of a
drawn slot and then its origin. As two columns the origin was one more miss per row on each side; side by side,
the second access finds the line the first one brought in.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt

from gigashuffle.errors import AttachError
from gigashuffle.host.pids import pid_namespace
from gigashuffle.shm.holders import REGISTRY_BYTES, HolderRegistry
from gigashuffle.shm.journal import (
    H_EMPTY,
    H_FULL,
    H_LENGTH,
    H_MAGIC,
    H_OWNER,
    H_PIDNS,
    H_READ,
    H_SLOTS,
    H_STRIPES,
    H_WRITTEN,
    HEADER_BYTES,
    MAX_STRIPES,
    WIDE_BYTES,
    Journal,
    WideJournal,
)  # fmt: skip
from gigashuffle.shm.lanes import LANES
from gigashuffle.shm.memfd import SharedMemory
from gigashuffle.shm.nodelock import NodeLock
from gigashuffle.shm.picker import SlotPicker
from gigashuffle.shm.stripes import Stripe, WidePending, default_stripes
from gigashuffle.shm.tablereadings import ShuffleBufferStats, TableReadings

Versions = npt.NDArray[np.int64]

_MAGIC = 0x67735F736C6F7461  # "gs_slota": striped


def table_nbytes(slots: int, stripes: int | None = None) -> int:
    s = default_stripes(slots) if stripes is None else stripes
    per_slot = 8 + 8 + 4 + 4 + 4 + 4 + 1
    return HEADER_BYTES * s + WIDE_BYTES + REGISTRY_BYTES + 8 * LANES * s + slots * per_slot + 64


class SlotMap(TableReadings):
    """A slot table's memory: ``memory=None`` creates it (every slot empty) with ``stripes`` stripes (None:
    ``default_stripes(slots)``; the memory's size says how many, see ``table_nbytes``); else it maps ``memory`` and
    checks that it is a table of ``slots`` slots made in this pid namespace. The transitions are ``SlotTable``'s."""

    def __init__(
        self, slots: int, memory: SharedMemory | None = None, seed: int | None = None, stripes: int | None = None
    ) -> None:
        if slots <= 0:
            raise ValueError(f"a slot table needs at least one slot, got slots={slots}")
        s = default_stripes(slots) if stripes is None else stripes
        per = -(-slots // s) if s > 0 else 0
        if not 0 < s <= MAX_STRIPES or (s - 1) * per >= slots:
            raise ValueError(f"a table of {slots} slots splits into 1 to {min(MAX_STRIPES, slots)} stripes of "
                             f"ceil(slots / stripes) slots each, none empty: got stripes={stripes}")  # fmt: skip
        self.slots, self.stripes, self.stripe_slots = slots, s, per
        self.memory = memory or SharedMemory(table_nbytes(slots, s), name="gigashuffle-slots")
        if self.memory.fd is None:
            raise ValueError("a slot table needs the memfd itself (to open its own lock), not a closed one")
        raw = self.memory.numpy_view(0, table_nbytes(slots, s))
        self._header = raw[:HEADER_BYTES].view(np.int64)  # stripe 0's, and the table's
        offset = HEADER_BYTES
        wide_header = raw[offset : offset + HEADER_BYTES].view(np.int64)
        wide_counts = raw[offset + HEADER_BYTES : offset + WIDE_BYTES].view(np.int64)
        offset += WIDE_BYTES
        headers = [self._header] + [
            raw[offset + HEADER_BYTES * i : offset + HEADER_BYTES * (i + 1)].view(np.int64) for i in range(s - 1)
        ]
        offset += HEADER_BYTES * (s - 1)
        self._holders = HolderRegistry(raw[offset : offset + REGISTRY_BYTES].view(np.int64).reshape(-1, 2))
        offset += REGISTRY_BYTES
        self._lanes = raw[offset : offset + 8 * LANES * s].view(np.int64).reshape(s, LANES)
        offset += 8 * LANES * s
        # Interleaved, one 16-byte record per slot (NOTE [ Version and origin ] above): strided views, so index
        # them (``v[ids]``, ``v[ids] = x``); ``take``/``put`` would copy the whole column first.
        stamps = raw[offset : offset + 16 * slots].view(np.int64).reshape(slots, 2)
        self.version, self.origin = stamps[:, 0], stamps[:, 1]
        offset += 16 * slots
        self.holder = raw[offset : offset + 4 * slots].view(np.int32)
        journal_ids = raw[offset + 4 * slots : offset + 8 * slots].view(np.int32)
        wide_ids = raw[offset + 8 * slots : offset + 12 * slots].view(np.int32)
        offset += 12 * slots
        self.writer = raw[offset : offset + 4 * slots].view(np.int32)
        offset += 4 * slots
        self.state = raw[offset : offset + slots]
        if memory is None:
            self._header[[H_MAGIC, H_SLOTS, H_STRIPES, H_PIDNS]] = (_MAGIC, slots, s, pid_namespace())
            for k, header in enumerate(headers):
                header[H_EMPTY] = min(slots, (k + 1) * per) - k * per
            self.origin[:] = -1
        elif self._header[H_MAGIC] != _MAGIC or self._header[H_SLOTS] != slots or self._header[H_STRIPES] != s:
            raise ValueError(f"shared memory fd {self.memory.fd} is not a slot table of {slots} slots")
        elif self._header[H_PIDNS] != pid_namespace():
            raise AttachError(
                f"the node buffer was created in pid namespace {int(self._header[H_PIDNS])} and this process runs in "
                f"{pid_namespace()} (another container?): its slots are held under pids this process cannot check; "
                "run every process of a node in one pid namespace (e.g. docker --pid=host or a shared pod)"
            )
        self._stripes = [
            Stripe(k, k * per, min(slots, (k + 1) * per), headers[k],
                   Journal(headers[k], journal_ids[k * per : (k + 1) * per], self.state, self.holder, self._lanes[k]),
                   NodeLock(self.memory, k, headers[k].data[H_OWNER : H_OWNER + 1]), wide_header.data, seed)
            for k in range(s)
        ]  # fmt: skip
        self._wide = WideJournal(
            wide_header, wide_counts, [stripe.words for stripe in self._stripes], wide_ids, self.state, self.holder,
            self._lanes[0],
        )  # fmt: skip
        self._picker = SlotPicker(slots, seed)  # the wide draws'
        self._random = random.Random(seed)  # the choice of stripes (Python's: a tenth of a numpy call's cost)

    @property
    def fd(self) -> int | None:
        return self.memory.fd

    # -- locking and the journals ----------------------------------------------------------------------------
    def _take(self, stripe: Stripe, wait_s: float | None = None) -> None:
        """Take one stripe's lock; if a wide op's holder died inside it, roll that forward under every lock first
        (NOTE [ Stripes ] in shm/stripes.py)."""
        while True:
            try:
                stripe.acquire(wait_s)
                return
            except WidePending:  # released: take them all, which rolls it forward, and try again
                pass
            self._acquire_all(wait_s)
            self._release_all()

    # Every lock: the wide ops, and tests of the one-stripe table's journal.
    def _acquire(self, wait_s: float | None = None) -> None:
        self._acquire_all(wait_s)

    def _release(self) -> None:
        self._release_all()

    @property
    def _journal(self) -> Journal:
        """Stripe 0's journal (a one-stripe table's only one)."""
        return self._stripes[0].journal

    @property
    def _lock(self) -> NodeLock:
        """Stripe 0's lock (a one-stripe table's only one)."""
        return self._stripes[0].lock

    def _acquire_all(self, wait_s: float | None = None) -> None:
        """Take every stripe's lock in stripe order (never another order: NOTE [ Stripes ]), rolling each stripe's
        journal and then the wide one forward; with ``wait_s``, raise NodeLockBusy if the whole takes that long."""
        self._acquire_from(0, None if wait_s is None else time.monotonic() + wait_s, wait_s)

    def _acquire_from(self, i: int, deadline: float | None, wait_s: float | None) -> None:
        # Recursive rather than a loop, so that each lock taken is released by its own frame's handler whatever
        # raises after it (the kill tests raise at every line: tests/unit/test_slottable_kills.py).
        stripe = self._stripes[i]
        stripe.acquire(wait_s if deadline is None or not i else max(0.0, deadline - time.monotonic()), wide=True)
        try:
            if i + 1 < len(self._stripes):
                self._acquire_from(i + 1, deadline, wait_s)
            elif self._wide.words[H_LENGTH]:
                self._wide.roll_forward()
        except BaseException:
            stripe.release()
            raise

    def _release_all(self) -> None:
        """Release every stripe's lock, the last first, each even if an earlier release raised (a deferred Ctrl-C
        is delivered by the outermost section's release, stripe 0's: NOTE [ The node lock under signals and
        fork ] in shm/nodelock.py)."""
        self._release_from(len(self._stripes) - 1)

    def _release_from(self, i: int) -> int:
        """Release stripes ``i`` down to 0; returns how many."""
        try:
            self._stripes[i].release()
        finally:
            below = i and self._release_from(i - 1)  # one line: a release the kill tests do not cut before its call
        return below + 1

    @contextmanager
    def _locked(self, wait_s: float | None = None) -> Iterator[None]:
        """Every stripe's lock (the wide ops)."""
        self._acquire_all(wait_s)
        try:
            yield
        finally:
            self._release_all()

    def counts(self) -> tuple[int, int, ShuffleBufferStats]:
        """Rows written and read, and the slot counts, read from the headers without the locks, so this never waits
        (the heartbeat and the fill progress call it; NOTE [ A stopped lock holder ] in shm/slottable.py). Each
        figure is a sum of aligned words that were each true at some moment; together they may straddle a few
        transitions."""
        written = read = full = empty = 0
        for stripe in self._stripes:
            words = stripe.words
            written += words[H_WRITTEN]
            read += words[H_READ]
            full += words[H_FULL]
            empty += words[H_EMPTY]
        read += self._wide.words[H_READ]
        return written, read, ShuffleBufferStats(full, empty, self.slots - full - empty)

    def close(self) -> None:
        """Drop this process's lock descriptions and mapping (live numpy views keep the mapping)."""
        for stripe in self._stripes:
            stripe.lock.close()
        self.memory.close()
        # The views hold the mapping; dropping them unmaps it unless a caller still holds one.
        self._header = self.version = self.origin = np.empty(0, dtype=np.int64)
        self._lanes = np.empty((1, 0), dtype=np.int64)
        self.holder = self.writer = np.empty(0, dtype=np.int32)
        self.state = np.empty(0, dtype=np.uint8)
        self._stripes = []
        self._wide = WideJournal(
            self._header, self._header, [], np.empty(0, dtype=np.int32), self.state, self.holder, self._header
        )
        self._holders = HolderRegistry(np.empty((0, 2), dtype=np.int64))
