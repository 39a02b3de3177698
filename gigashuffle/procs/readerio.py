"""What both reader loops do with the ring and the channel: open the ring and send it to the trainer, gather drawn
slots into it, collect freed ring slots, pause for a checkpoint's cut (NOTE [ Reader cycle ] in procs/reader.py)."""

from __future__ import annotations

import time
from collections import deque

from gigashuffle.procs import failpoints
from gigashuffle.procs.childenv import ChildEnv
from gigashuffle.procs.messages import FreeSlot, Pause, Paused, Rejoin, Resume, RingReady, ToChild
from gigashuffle.shm.buffer import BatchRing, SlotBuffer, ring_depth_for
from gigashuffle.shm.counters import ChildCounters
from gigashuffle.shm.slotqueue import RECHECK_S, slots_per_wake
from gigashuffle.shm.slottable import SlotIds, SlotTable, Versions

_IDLE_POLL_S = 0.5


def _open_ring(env: ChildEnv, counters: ChildCounters) -> tuple[SlotBuffer, SlotTable, BatchRing]:
    if failpoints.ACTIVE:
        failpoints.reached("reader.before_attach")
    layout = env.attach_buffer()
    if env.buffer is None or env.table is None:
        raise AssertionError("reader has no buffer after attach")
    if env.table.slots != env.buffer.slots:  # _gather relies on it: every id the table hands out is a row
        raise AssertionError(f"slot table of {env.table.slots} slots for a buffer of {env.buffer.slots}")
    ring = BatchRing(layout, env.config.bs, ring_depth_for(env.config.ring_depth, layout, env.config.bs))
    fd, counters_fd = ring.memory.fd, counters.memory.fd
    if fd is None or counters_fd is None:
        raise AssertionError("a new ring or counters page has no fd")
    # The counters' fd travels with the ring's: NOTE [ Child counters ] in shm/counters.py.
    env.channel.send(RingReady(ring.nbytes, layout.to_json(), ring.depth), (fd, counters_fd))
    ring.memory.close_fd()
    counters.memory.close_fd()
    return env.buffer, env.table, ring


def _gather(buffer: SlotBuffer, ring: BatchRing, k: int, slots: SlotIds, versions: Versions) -> None:
    fields, index, kept_versions = ring.targets(k)
    buffer.gather(slots, fields, ids_in_range=True)  # drawn from the table, which _open_ring matched to the buffer
    index[:] = slots
    kept_versions[:] = versions


def _take_frees(env: ChildEnv, ring: BatchRing, free: deque[int], block_s: float) -> list[ToChild]:
    """Take the ring slots the trainer gave back and collect the channel's messages, waiting up to ``block_s`` for
    the first (slots given back meanwhile are taken next time). Apply a ``Rejoin``; return the messages other than
    doorbells and rejoins."""
    free.extend(ring.returns.take())
    return _messages(env, block_s)


def _wait_for_slot(env: ChildEnv, ring: BatchRing, free: deque[int], block_s: float) -> list[ToChild]:
    """``_take_frees`` for a reader with no free ring slot: wait up to ``block_s`` for a slot given back or a
    message, whichever comes first (NOTE [ Slot queues ] in shm/slotqueue.py)."""
    free.extend(ring.returns.take())
    if free:
        return _messages(env, 0)
    # Then look again: a slot given back before the trainer saw this word rings nothing.
    ring.returns.wake_at(slots_per_wake(ring.depth))
    try:
        deadline = time.monotonic() + block_s
        while True:
            free.extend(ring.returns.take())
            if free:
                return _messages(env, 0)
            others = _messages(env, min(RECHECK_S, max(0.0, deadline - time.monotonic())))
            if others or time.monotonic() >= deadline:
                free.extend(ring.returns.take())
                return others
    finally:
        ring.returns.stop_waiting()


def _messages(env: ChildEnv, block_s: float) -> list[ToChild]:
    others: list[ToChild] = []
    timeout = block_s
    while env.channel.poll(timeout):
        message, _ = env.channel.recv()
        if isinstance(message, Rejoin):
            env.rejoin(message.generation)
        elif not isinstance(message, FreeSlot):
            others.append(message)
        timeout = 0
    return others


def _pausing(messages: list[ToChild]) -> int | None:
    """The cut number of the last of the cut's messages among ``messages`` if it is a ``Pause`` (a Resume may
    follow at once), else None."""
    cut = [m for m in messages if isinstance(m, (Pause, Resume))]
    return cut[-1].cut if cut and isinstance(cut[-1], Pause) else None


def _pause(env: ChildEnv, ring: BatchRing, free: deque[int], cut: int) -> None:
    """A checkpoint's cut (NOTE [ Checkpoint cut ] in checkpoint/cut.py): every batch drawn is announced; say so and
    draw nothing until ``Resume``."""
    env.channel.send(Paused(cut))
    paused = True
    while paused:
        # A reader slow to read its channel (two cores, busy) may find a Resume and the next cut's Pause together:
        # that Pause needs its own Paused, or the next cut waits for this reader until it times out.
        for message in _take_frees(env, ring, free, _IDLE_POLL_S):
            if isinstance(message, Resume):
                paused = False
            elif isinstance(message, Pause):
                env.channel.send(Paused(message.cut))
                paused = True
