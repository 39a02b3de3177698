"""The trainer's inbox: one home for the trainer-side life of a reader's ring slot.

NOTE [ A ring slot's walk ]
A batch walks from a reader to the trainer and back through the reader, this inbox and the reader's ring only:
  1. the reader gathers rows into ring slot ``k`` and announces it through the ring (NOTE [ Slot queues ] in
     shm/slotqueue.py); the trainer's pump takes it (before it blocks, and before each message it reads from that
     reader), or ``next()`` does, between pumps (NOTE [ Batches between pumps ] in trainer/batches.py): the slot is
     *ready*;
  2. the loader ``pop()``s it and ``hand_over()`` makes the batch: views of the ring (the slot is *held* until the
     caller drops the last of them), a device copy (held until the copy is done: NOTE [ GPU placement ] in
     pinning.py), or, when the caller keeps most of the ring, a copy, and the slot goes back at once. A hand-over
     that raises (a CUDA OOM in the device copy, a failed wait, an interrupt) still returns the slot: at once if
     nothing was queued that reads it, else once the copy stream has passed what was;
  3. the next flush's ``buffer.reclaim()`` records a dropped batch's slot (*dropped*), and the flush gives it back to
     the reader through the ring (NOTE [ Slot queues ]): the reader may gather into it again.
A fill_once pass (``open_pass``) ends when the reader's ``PassEnd`` has come and no batch of it is ready. Slots of a
reader that died are never given back (its ring is gone with it); the inbox forgets such a reader, and unmaps its
ring, once no batch of it is ready or held.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Iterator

from gigashuffle.procs.interrupts import critical
from gigashuffle.procs.messages import SLOT_DOORBELL, StartPass
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.shm import buffer
from gigashuffle.trainer.pinning import Batch, Placement

log = logging.getLogger(__name__)


class DroppedBatches:
    """The ring slots of dropped batches, until the trainer gives them back (NOTE [ A ring slot's walk ], step 3)."""

    def __init__(self) -> None:
        self._dropped: deque[tuple[ChildProcess, int]] = deque()  # appended by buffer.reclaim() and device copies

    def release_later(self, child: ChildProcess, k: int) -> Callable[[], None]:
        """What returns ring slot ``k`` of ``child`` once its batch is gone, run by ``buffer.reclaim()`` inside a
        section (NOTE [ Reclaimed ring slots ] in shm/ring.py)."""
        return functools.partial(self._dropped.append, (child, k))

    def due(self) -> Iterator[tuple[ChildProcess, int]]:
        """Drain the dropped batches, oldest first. The caller runs the whole loop in one ``critical()`` section: a
        slot popped here and not yet given back is in no list."""
        buffer.reclaim()  # batches whose views died since: NOTE [ Reclaimed ring slots ] in shm/ring.py
        dropped = self._dropped
        while dropped:
            child, k = dropped.popleft()
            child.held -= 1
            yield child, k

    def clear(self) -> None:
        self._dropped.clear()


# The one fill_once pass a reader runs at a time (``StartPass`` / ``PassEnd`` number).
_PASS = 0


class Inbox:
    """The ring slots of this rank's readers while the trainer has them: ready, held and dropped, the pass
    protocol, and forgetting dead readers (NOTE [ A ring slot's walk ]). ``children`` is the supervisor's list of
    children: the inbox removes from it, in place, exited children it no longer refers to."""

    def __init__(self, placement: Placement, children: list[ChildProcess]) -> None:
        self._placement = placement
        self._children = children
        self._ready: deque[tuple[ChildProcess, int]] = deque()
        self._dropped = DroppedBatches()
        self._passes_ended: set[int] = set()  # fill_once passes whose reader sent PassEnd
        self._pass_open = False
        self._dead = 0  # children that exited and are still listed (see _forget_dead)

    # -- what the readers announced -------------------------------------------------------------------------
    def take_announced(self, child: ChildProcess) -> int:
        """Take ``child``'s new announcements; how many batches (the caller is inside a ``critical()`` section)."""
        ring = child.ring
        if ring is None:
            return 0
        ks = ring.announcements.take()
        if ks:
            self.announced(child, ks)
        return len(ks)

    def take_announcements(self) -> int:
        """Take every reader's new announcements without a pump (NOTE [ Batches between pumps ] in
        trainer/batches.py); how many batches. The caller is inside a ``critical()`` section."""
        return sum(self.take_announced(child) for child in self._children)

    def expect_announcements(self) -> tuple[int, int]:
        """Before the trainer blocks: ask every reader with a ring for a doorbell when it announces, then take what
        it announced before it saw the request, and wake every reader that waits for a batch of slots given back
        with those it has (NOTE [ Slot queues ]); (readers asked, batches taken). The caller is inside a
        ``critical()`` section."""
        asked = taken = 0
        for child in self._children:
            ring = child.ring
            if ring is not None:
                ring.announcements.wake_at(1)
                asked += 1
                taken += self.take_announced(child)
                if ring.returns.waits[0] and child.alive:
                    self._ring_slot_doorbell(child)
        return asked, taken

    def stop_expecting(self) -> None:
        """The trainer is awake: no reader needs to ring for its announcements."""
        for child in self._children:
            if child.ring is not None:
                child.ring.announcements.stop_waiting()

    def announced(self, child: ChildProcess, ks: list[int]) -> None:
        ring = child.ring
        if ring is not None:
            seq = ring.seq
            for k in ks:
                seq[k] = 0  # the trainer has them now (NOTE [ Lanes ] in shm/lanes.py)
        self._ready.extend((child, k) for k in ks)

    def recover(self, child: ChildProcess, released: int) -> int:
        """A reader died: its ring slots numbered up to ``released`` (its lane) were released and never announced.
        They are ready now, in the order they were gathered (NOTE [ Lanes ] in shm/lanes.py); returns how many."""
        ring = child.ring
        if ring is None:
            return 0
        seq = ring.seq
        found = sorted((int(seq[k]), k) for k in range(ring.depth) if 0 < seq[k] <= released)
        self.announced(child, [k for _n, k in found])
        return len(found)

    def pass_ended(self, number: int) -> None:
        self._passes_ended.add(number)

    def child_exited(self) -> None:
        """A child exited: forget it at the next flush once nothing of it is ready or held."""
        self._dead += 1

    # -- ready batches ---------------------------------------------------------------------------------------
    @property
    def ready(self) -> int:
        """How many announced batches wait to be handed over."""
        return len(self._ready)

    def waiting(self) -> Iterator[tuple[ChildProcess, int]]:
        """The ready batches, oldest first, as (reader, ring slot): read-only (the checkpoint's cut copies them)."""
        return iter(tuple(self._ready))

    def pop(self) -> tuple[ChildProcess, int]:
        """The oldest ready batch; the caller hands it over (``hand_over``) or frees it in the same section."""
        return self._ready.popleft()

    def hand_over(self, child: ChildProcess, k: int) -> Batch:
        """Batch ``k`` of ``child``'s ring as the caller gets it: the ring's views, a device copy, or, when the
        caller holds most of the ring, a copy (the slot goes back at once, so the reader can go on: never a stall).
        If this raises (a CUDA OOM in the device copy, a failed wait for a copy, an interrupt), the slot still goes
        back: at once, or once nothing that may read it is left (NOTE [ A ring slot's walk ], step 2)."""
        ring = child.ring
        if ring is None:
            raise AssertionError("a batch arrived before its reader's ring")
        placement = self._placement
        if placement.moves:
            # The caller gets device tensors and never holds ring memory; the slot is released after the copy,
            # and after whatever was queued if the copy fails (``Placement.deliver`` releases on every way out).
            child.held += 1
            return placement.deliver(ring, k, self._dropped.release_later(child, k))
        handed = False  # whether the slot's return is the batch's (its views' death) rather than ours
        try:
            if child.held >= ring.depth - 1 and placement.pending:
                self._await_copies(child, ring.depth - 1)
            if child.held >= ring.depth - 1:
                # The caller keeps many batches: hand out a copy (pinned with pinned rings) so that the reader can
                # go on, rather than stall; the slot goes back below.
                return placement.clone(ring.batch(k))
            child.held += 1
            handed = True
            return placement.deliver(ring, k, self._dropped.release_later(child, k))
        finally:
            if not handed:
                self.free(child, k)

    def _await_copies(self, child: ChildProcess, limit: int) -> None:
        """Pinned rings: wait for the oldest pending copies until ``child`` holds fewer than ``limit`` slots, rather
        than hand out a pageable copy for slots the caller already dropped (NOTE [ GPU placement ])."""
        placement = self._placement
        while child.held >= limit and placement.pending:
            if not placement.poll():
                placement.poll(wait=True)
            self.flush()

    def starved(self, readers: list[ChildProcess]) -> bool:
        """Whether every reader with a ring has all its slots in the caller's hands (none left to gather into)."""
        rings = [c for c in readers if c.ring is not None]
        return bool(rings) and all(c.ring is not None and c.held >= c.ring.depth for c in rings)

    # -- frees -----------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Give the ring slots of batches the caller dropped back to their readers."""
        with critical():  # a slot drained from the queue and not yet given back is in no list (NOTE [ Ctrl-C ])
            self.give_back_dropped()

    def give_back_dropped(self) -> None:
        """``flush``'s work, for a caller already inside a ``critical()`` section (``next()``'s: a nested section
        costs a third of a microsecond a batch, and counts nothing that the outer one does not)."""
        for child, k in self._dropped.due():
            self.free(child, k)
        if self._dead:
            self._forget_dead()

    def free(self, child: ChildProcess, k: int) -> None:
        """Give ring slot ``k`` back to ``child`` now, ringing its doorbell if it waits for one (NOTE [ Slot queues ]
        in shm/slotqueue.py); a dead reader's is not given back: its ring is gone with it."""
        ring = child.ring
        if child.alive and ring is not None and ring.returns.put((k,)):
            self._ring_slot_doorbell(child)

    def _ring_slot_doorbell(self, child: ChildProcess) -> None:
        try:
            child.channel.send(SLOT_DOORBELL)
        except OSError:
            log.debug("%s %d is gone; its doorbell for ring slots given back is not rung", child.role, child.index)

    def _forget_dead(self) -> None:
        """Drop exited children once nothing refers to them: no batch of theirs waits or is held, and none is to
        be started again. A week of restarts must not keep every dead reader's ring mapped in the trainer."""
        waiting = {id(child) for child, _k in self._ready}
        kept: list[ChildProcess] = []
        for child in self._children:
            if child.alive or child.superseded or child.held > 0 or id(child) in waiting:
                kept.append(child)
            else:
                if child.ring is not None:
                    child.ring.close()  # views the caller still holds keep their pages mapped
                    child.ring = None
                if child.counters is not None:
                    child.counters.close()
                    child.counters = None
        self._children[:] = kept
        self._dead = sum(not child.alive for child in kept)

    # -- the fill_once pass ----------------------------------------------------------------------------------
    @property
    def pass_over(self) -> bool:
        """The open pass's reader sent ``PassEnd`` (its last batches may still be ready)."""
        return _PASS in self._passes_ended

    def open_pass(self, reader: ChildProcess) -> None:
        """Ask ``reader`` for one pass over the buffer."""
        with critical():  # a pass asked for is a pass open: NOTE [ Ctrl-C ]
            self._passes_ended.discard(_PASS)
            reader.channel.send(StartPass(_PASS))
            self._pass_open = True

    def close_pass(self) -> None:
        """The pass is over and every batch of it was handed over."""
        self._passes_ended.discard(_PASS)
        self._pass_open = False

    def abandon_pass(self, pump: Callable[[], None]) -> None:
        """Discard the rest of a pass the caller abandoned, so the next pass starts at its first batch."""
        while self._pass_open:
            while self._ready:
                with critical():
                    child, k = self._ready.popleft()
                    self.free(child, k)
            if self.pass_over:
                self.close_pass()
            else:
                pump()

    def clear(self) -> None:
        """At shutdown: the readers are gone, and so is every slot still to return."""
        self._ready.clear()
        self._dropped.clear()
