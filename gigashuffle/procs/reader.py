"""The reader loop: gather random full slots into the ring, tell the trainer which ring slot is ready.

NOTE [ Reader cycle ]
The trainer maps the reader's ring (its fd crosses once, at start); then the ring slots of each draw's batches go to the
trainer, and come back, through the ring itself (a ``BatchReady`` or ``FreeSlot`` doorbell only for a side that waits:
NOTE [ Slot queues ] in shm/slotqueue.py), and nothing goes to Redis. Per hold of the node lock the reader draws the
slots of as many batches as it has free ring slots, up to ``shuffle_size // (8 * bs)`` (a transition holds the lock for
tens of microseconds however small it is, so fewer and larger ones leave the lock free more often, and a reader never
holds more than an eighth of the buffer). ``draw_full`` takes them uniformly at random among the full slots (``reading``
under this pid, once at least ``min_full_slots`` are full); the rows, their slot ids and versions are gathered into the
free ring slots, ``bs`` rows each, without any lock held; ``release_read`` returns the slots (to empty, or to full when
evict_on_read=False), and only then are the batches announced. With free ring slots left, that release and the next draw
share one hold of the lock (``release_and_draw``). A reader killed before the release leaves ``reading`` slots, which
``repair()`` returns to full (never delivered); killed between release and announcement, its batches are delivered by
the trainer from its ring, once: the release moves the reader's lane in the same journaled op (NOTE [ Lanes ] in
shm/lanes.py; before lanes those batches were lost). The reader draws only for free ring slots, so a reader blocked on a
slow trainer holds no slots and cannot starve the rest of the node. Up to the ring's depth of batches are in flight
(NOTE [ Ring depth ] in shm/ring.py).

Up to four batches per draw: the lock, the trainer's wake-up and the announcement are paid once per draw, not
per batch (today's figures and the measurement that chose four: docs/benchmarks.md).

With fill_once=True the reader waits for a full buffer, then gathers this rank's share of the slots in slot
order, once per pass the trainer asks for, drawing nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

from gigashuffle.procs import failpoints
from gigashuffle.procs.channel import Channel
from gigashuffle.procs.childenv import ChildEnv
from gigashuffle.procs.childspec import ChildSpec
from gigashuffle.procs.chores import Backoff, Housekeeping
from gigashuffle.procs.fillonce import _serve_passes
from gigashuffle.procs.messages import BATCH_DOORBELL
from gigashuffle.procs.readerio import (
    _IDLE_POLL_S,
    _gather,
    _open_ring,
    _pause,
    _pausing,
    _take_frees,
    _wait_for_slot,
)
from gigashuffle.procs.readermetrics import _WRITERS_SAMPLED, _account_draw, _count_writers
from gigashuffle.shm.buffer import BatchRing, SlotBuffer
from gigashuffle.shm.counters import R_BATCHES, R_GATHER_S, R_STARVED_S, ChildCounters
from gigashuffle.shm.lanes import NO_LANE, reader_lane
from gigashuffle.shm.slottable import SlotIds, SlotTable, Versions

log = logging.getLogger(__name__)

# A reader holds at most one in this many of the buffer's slots at once (NOTE [ Reader cycle ]).
_HELD_ONE_IN = 8
# A draw is all in one stripe (NOTE [ Stripes ] in shm/stripes.py), chosen among those with as many full slots: it
# takes at most one in this many of a stripe's slots, so that a stripe is rarely short of them.
_STRIPE_ONE_IN = 4


def run(spec: ChildSpec, channel: Channel) -> None:
    env = ChildEnv(spec, channel)
    try:
        counters = ChildCounters()
        buffer, table, ring = _open_ring(env, counters)
        if spec.config.fill_once:
            _serve_passes(env, buffer, table, ring)
        else:
            _stream(env, buffer, table, ring, counters)
    finally:
        env.close()


def _stream(env: ChildEnv, buffer: SlotBuffer, table: SlotTable, ring: BatchRing, counters: ChildCounters) -> None:
    cfg = env.config
    me = os.getpid()
    bs, min_full, evict = cfg.bs, cfg.min_full_slots, cfg.evict_on_read  # min_full_slots is computed per access
    most = max(1, min(cfg.shuffle_size // (_HELD_ONE_IN * bs), table.stripe_slots // (_STRIPE_ONE_IN * bs)))
    free: deque[int] = deque(range(ring.depth))
    backoff = Backoff()
    chores = Housekeeping(env)
    drawn: tuple[SlotIds, Versions] | None = None  # the next batches' slots, drawn with the last release
    cells = counters.cells  # NOTE [ Child counters ] in shm/counters.py
    lane = _Lane(table, reader_lane(cfg.local_rank, env.spec.index) if evict else NO_LANE)
    while True:
        # Slots are drawn only with a free ring slot.
        others = _take_frees(env, ring, free, 0) if free else _wait_for_slot(env, ring, free, _IDLE_POLL_S)
        if (cut := _pausing(others)) is not None:
            if drawn is not None:  # drawn with the last release: gather them, so that the cut finds them in the ring
                _announce(env, buffer, table, ring, free, drawn, me, lane, 0, counters)
                drawn = None
            _pause(env, ring, free, cut)
            continue
        chores.tick()
        if drawn is None:
            if not free:
                continue
            drawn = draw_batches(table, me, bs, min(len(free), most), min_full)
            _account_draw(counters, table, None if drawn is None else drawn[1])
            if drawn is None:  # fewer full slots than the mixing threshold: starved by the writers
                starved_since = time.monotonic()
                backoff.sleep()
                cells[R_STARVED_S] += time.monotonic() - starved_since
                continue
        backoff.reset()
        want = min(len(free) - len(drawn[0]) // bs, most) * bs
        drawn = _announce(env, buffer, table, ring, free, drawn, me, lane, want, counters, min_full)


def _announce(
    env: ChildEnv,
    buffer: SlotBuffer,
    table: SlotTable,
    ring: BatchRing,
    free: deque[int],
    drawn: tuple[SlotIds, Versions],
    me: int,
    lane: _Lane,
    want: int,
    counters: ChildCounters,
    min_full: int = 0,
) -> tuple[SlotIds, Versions] | None:
    """Gather the drawn slots into free ring slots, release them (drawing ``want`` more in the same hold of the
    lock), announce the batches; return what was drawn next."""
    bs = env.config.bs
    slots, versions = drawn
    ring_slots = [free.popleft() for _ in range(len(slots) // bs)]
    gather_since = time.monotonic()
    origins = env.config.checkpoint_rows == "positions"  # NOTE [ Positions checkpoint ] in checkpoint/positions.py
    for i, k in enumerate(ring_slots):
        _gather(buffer, ring, k, slots[i * bs : (i + 1) * bs], versions[i * bs : (i + 1) * bs])
        if origins:  # the rows' origins travel with the batch, for a cut that finds it announced and not delivered
            ring.origins(k)[:] = table.origin[slots[i * bs : (i + 1) * bs]]
    words = counters.words  # NOTE [ Child counters ] in shm/counters.py
    words[R_GATHER_S] += time.monotonic() - gather_since
    words[R_BATCHES] += len(ring_slots)
    if _WRITERS_SAMPLED():
        _count_writers(table, slots[:bs], words)
    following: tuple[SlotIds, Versions] | None = None
    evict, batches = env.config.evict_on_read, len(ring_slots)
    lane.number(ring, ring_slots)
    if want > 0:
        released, next_slots, next_versions = table.release_and_draw(
            me, slots, evict, want, min_full, lane.lane, batches
        )
        following = (next_slots, next_versions) if len(next_slots) else None
        _account_draw(counters, table, next_versions)
    else:
        released = table.release_read(me, slots, evict, lane.lane, batches)
    lane.released += batches
    if failpoints.ACTIVE:
        failpoints.reached("reader.after_release")
    if released != len(slots):
        raise AssertionError(f"reader {me} lost slots it was reading (repaired as a dead holder's?)")
    if ring.announcements.put(ring_slots):  # the trainer waits for a batch (NOTE [ Slot queues ])
        env.channel.send(BATCH_DOORBELL)
    return following


class _Lane:
    """This reader's lane (NOTE [ Lanes ] in shm/lanes.py): how many batches it and its predecessors released."""

    def __init__(self, table: SlotTable, lane: int) -> None:
        self.lane = lane
        # Read under the lock: a release a dead predecessor was inside is rolled forward first.
        self.released = table.lane_values((lane,))[0] if lane != NO_LANE else 0

    def number(self, ring: BatchRing, ring_slots: list[int]) -> None:
        """Number the batches about to be released, before the release (the trainer finds them by it if this
        reader dies before it announces them)."""
        if self.lane != NO_LANE:
            for i, k in enumerate(ring_slots):
                ring.seq[k] = self.released + i + 1


def draw_batches(table: SlotTable, me: int, bs: int, batches: int, min_full: int) -> tuple[SlotIds, Versions] | None:
    """Slots for ``batches`` batches, or for one when too few are full for that many; None when none can be drawn."""
    for count in (batches, 1) if batches > 1 else (1,):
        slots, versions = table.draw_full(me, count * bs, min_full)
        if len(slots):
            return slots, versions
    return None
