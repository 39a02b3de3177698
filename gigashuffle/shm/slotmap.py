"""The slot table's memory: its layout in the memfd, the views over it, the node lock around a transition, and the
readings of its header that take no lock (the transitions are in shm/slottable.py: NOTE [ Slot table ] there).

Layout: the header (counts, clock, lock figures, journal: shm/journal.py), the holder registry (shm/holders.py), the
lanes (shm/lanes.py), then per slot its ``version`` (int64) and ``origin`` (int64: where the row came from, stamped
by its writer outside the lock for checkpoints by positions, NOTE [ Positions checkpoint ] in checkpoint/positions.py;
-1 unknown) side by side, ``holder`` (int32), the journal's id column (int32) and ``state`` (uint8).

NOTE [ Version and origin ]
A slot's version and origin share one 16-byte record, so one cache line holds both. Slots are touched in random
order, so each column costs a cache miss per row wherever it is read or written: the writer stamps a reserved
slot's version and, checkpointing by positions, its origin a little later; the reader reads the version of a
drawn slot and then its origin. As two columns the origin was one more miss per row on each side; side by side,
the second access finds the line the first one brought in.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gigashuffle.errors import AttachError, NodeLockBusy
from gigashuffle.host.pids import pid_namespace
from gigashuffle.shm.buffer import SharedMemory
from gigashuffle.shm.holders import REGISTRY_BYTES, HolderRegistry
from gigashuffle.shm.journal import (
    H_CLOCK,
    H_EMPTY,
    H_FULL,
    H_HELD_NS,
    H_HOLDS,
    H_LENGTH,
    H_MAGIC,
    H_PIDNS,
    H_READ,
    H_SLOTS,
    H_WRITTEN,
    HEADER_BYTES,
    Journal,
)
from gigashuffle.shm.lanes import LANES
from gigashuffle.shm.nodelock import NodeLock
from gigashuffle.shm.picker import SlotPicker

Versions = npt.NDArray[np.int64]

_MAGIC = 0x67735F736C6F7439  # "gs_slot9": version and origin side by side


@dataclass(frozen=True)
class LockUsage:
    """How much a node's slot-table lock has been held since its buffer was created: compare two readings over a
    wall-clock interval to see what share of the node's time its transitions took (NOTE [ Node lock budget ] in
    shm/slottable.py)."""

    held_s: float
    holds: int


@dataclass(frozen=True)
class ShuffleBufferStats:
    """Slot counts of a node's buffer: ``full + empty + in_flight == shuffle_size`` once it is allocated."""

    full: int
    empty: int
    in_flight: int


def table_nbytes(slots: int) -> int:
    return HEADER_BYTES + REGISTRY_BYTES + 8 * LANES + slots * (8 + 8 + 4 + 4 + 4 + 1) + 64


class SlotMap:
    """A slot table's memory: ``memory=None`` creates it (every slot empty); else it maps ``memory`` and checks that
    it is a table of ``slots`` slots made in this pid namespace. The transitions are ``SlotTable``'s."""

    def __init__(self, slots: int, memory: SharedMemory | None = None, seed: int | None = None) -> None:
        if slots <= 0:
            raise ValueError(f"a slot table needs at least one slot, got slots={slots}")
        self.slots = slots
        self.memory = memory or SharedMemory(table_nbytes(slots), name="gigashuffle-slots")
        if self.memory.fd is None:
            raise ValueError("a slot table needs the memfd itself (to open its own lock), not a closed one")
        raw = self.memory.numpy_view(0, table_nbytes(slots))
        self._header = raw[:HEADER_BYTES].view(np.int64)
        self._holders = HolderRegistry(raw[HEADER_BYTES : HEADER_BYTES + REGISTRY_BYTES].view(np.int64).reshape(-1, 2))
        offset = HEADER_BYTES + REGISTRY_BYTES
        self.lanes = raw[offset : offset + 8 * LANES].view(np.int64)
        offset += 8 * LANES
        # Interleaved, one 16-byte record per slot (NOTE [ Version and origin ] above): strided views, so index
        # them (``v[ids]``, ``v[ids] = x``); ``take``/``put`` would copy the whole column first.
        stamps = raw[offset : offset + 16 * slots].view(np.int64).reshape(slots, 2)
        self.version, self.origin = stamps[:, 0], stamps[:, 1]
        offset += 16 * slots
        self.holder = raw[offset : offset + 4 * slots].view(np.int32)
        journal_ids = raw[offset + 4 * slots : offset + 8 * slots].view(np.int32)
        offset += 8 * slots
        self.writer = raw[offset : offset + 4 * slots].view(np.int32)
        offset += 4 * slots
        self.state = raw[offset : offset + slots]
        self._journal = Journal(self._header, journal_ids, self.state, self.holder, self.lanes)
        if memory is None:
            self._header[[H_MAGIC, H_SLOTS, H_EMPTY, H_PIDNS]] = (_MAGIC, slots, slots, pid_namespace())
            self.origin[:] = -1
        elif self._header[H_MAGIC] != _MAGIC or self._header[H_SLOTS] != slots:
            raise ValueError(f"shared memory fd {self.memory.fd} is not a slot table of {slots} slots")
        elif self._header[H_PIDNS] != pid_namespace():
            raise AttachError(
                f"the node buffer was created in pid namespace {int(self._header[H_PIDNS])} and this process runs in "
                f"{pid_namespace()} (another container?): its slots are held under pids this process cannot check; "
                "run every process of a node in one pid namespace (e.g. docker --pid=host or a shared pod)"
            )
        self._picker = SlotPicker(slots, seed)
        self._lock = NodeLock(self.memory)
        self._held_since_ns = 0  # when this process last took the lock (only one thread holds it: NodeLock)

    @property
    def fd(self) -> int | None:
        return self.memory.fd

    # -- locking and the journal -----------------------------------------------------------------------------
    @contextmanager
    def _locked(self, wait_s: float | None = None) -> Iterator[None]:
        self._acquire(wait_s)
        try:
            yield
        finally:
            self._release()

    # The hot transitions call _acquire/_release in try/finally instead of ``with self._locked()``: a generator
    # context manager costs a few microseconds per use, several times per batch.
    def _acquire(self, wait_s: float | None = None) -> None:
        """Take the node lock, rolling forward an op its last holder died in; with ``wait_s``, raise NodeLockBusy
        if the lock stays held that long (see NOTE [ A stopped lock holder ] in shm/slottable.py)."""
        self._lock.acquire(wait_s)
        try:
            self._held_since_ns = time.perf_counter_ns()
            if self._header[H_LENGTH]:
                self._journal.roll_forward()
        except BaseException:
            self._lock.release()  # not _release(): its figures are for transitions, and this table may be closed
            raise

    def _release(self) -> None:
        # Statistics, not journaled: a holder killed here loses one hold's figures, nothing else; an exception
        # here (a table closed by another thread) must not keep the lock.
        try:
            header = self._header
            header[H_HELD_NS] += time.perf_counter_ns() - self._held_since_ns
            header[H_HOLDS] += 1
        finally:
            self._lock.release()

    def lane_values(self, lanes: tuple[int, ...], wait_s: float | None = None) -> tuple[int, ...]:
        """The values of ``lanes`` (NOTE [ Lanes ] in shm/lanes.py) once any op a dead process was inside is rolled
        forward: read under the lock. With ``wait_s``, a lock held that long (a stopped holder, which rolled forward
        when it took the lock) is read around, and the values are still final: only a process inside an op moves a
        lane, and that is the stopped holder, which is not the dead process asked about."""
        try:
            self._acquire(wait_s)
        except NodeLockBusy:
            return tuple(int(self.lanes[lane]) for lane in lanes)
        try:
            return tuple(int(self.lanes[lane]) for lane in lanes)
        finally:
            self._release()

    def lock_usage(self) -> LockUsage:
        """The node lock's total hold time and number of holds, from the header without the lock."""
        return LockUsage(int(self._header[H_HELD_NS]) / 1e9, int(self._header[H_HOLDS]))

    def full_and_clock(self) -> tuple[int, int]:
        """The full-slot count and the version clock (the last version handed out), from the header without the
        lock: a reader's metrics sample (NOTE [ Child counters ] in shm/counters.py)."""
        header = self._header
        return int(header[H_FULL]), int(header[H_CLOCK])

    def lock_holder(self) -> int | None:
        """The pid holding the node lock now (from ``/proc/locks``), or None."""
        return self._lock.holder()

    def counts(self) -> tuple[int, int, ShuffleBufferStats]:
        """Rows written and read, and the slot counts, read from the header without the lock, so this never waits
        (the heartbeat and the fill progress call it; NOTE [ A stopped lock holder ] in shm/slottable.py). Each
        figure is one aligned word that was true at some moment; together they may straddle one transition."""
        header = self._header
        written, read, full, empty = (int(header[i]) for i in (H_WRITTEN, H_READ, H_FULL, H_EMPTY))
        return written, read, ShuffleBufferStats(full, empty, self.slots - full - empty)

    def close(self) -> None:
        """Drop this process's lock description and mapping (live numpy views keep the mapping)."""
        self._lock.close()
        self.memory.close()
        # The views hold the mapping; dropping them unmaps it unless a caller still holds one.
        self._header = self.version = self.lanes = self.origin = np.empty(0, dtype=np.int64)
        self.holder = self.writer = np.empty(0, dtype=np.int32)
        self.state = np.empty(0, dtype=np.uint8)
        self._journal = Journal(self._header, np.empty(0, dtype=np.int32), self.state, self.holder, self.lanes)
        self._holders = HolderRegistry(np.empty((0, 2), dtype=np.int64))
