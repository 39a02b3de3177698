"""The fill_once reader loop: once the buffer is full, this rank's share of the slots in slot order, one pass per
``StartPass``, drawing nothing."""

from __future__ import annotations

from collections import deque

import numpy as np

from gigashuffle.procs.childenv import ChildEnv
from gigashuffle.procs.chores import Backoff, Housekeeping
from gigashuffle.procs.messages import BATCH_DOORBELL, PassEnd, StartPass
from gigashuffle.procs.readerio import _IDLE_POLL_S, _gather, _take_frees, _wait_for_slot
from gigashuffle.shm.buffer import BatchRing, SlotBuffer
from gigashuffle.shm.slottable import SlotTable


def _serve_passes(env: ChildEnv, buffer: SlotBuffer, table: SlotTable, ring: BatchRing) -> None:
    cfg = env.config
    backoff = Backoff(cap_s=0.05)
    chores = Housekeeping(env)
    while table.counts()[2].full < cfg.shuffle_size:  # the header's count: a poll that takes no lock
        chores.tick()
        backoff.sleep()
    per_rank = cfg.shuffle_size // cfg.local_world_size
    first = cfg.local_rank * per_rank
    order = np.arange(first, first + per_rank, dtype=np.intp)
    batches = per_rank // cfg.bs
    free: deque[int] = deque(range(ring.depth))
    while True:
        for message in _take_frees(env, ring, free, _IDLE_POLL_S):
            if not isinstance(message, StartPass):
                continue
            for b in range(batches):
                while not free:
                    _wait_for_slot(env, ring, free, _IDLE_POLL_S)
                k = free.popleft()
                ids = order[b * cfg.bs : (b + 1) * cfg.bs]
                _gather(buffer, ring, k, ids, table.version[ids])
                if ring.announcements.put((k,)):  # NOTE [ Slot queues ] in shm/slotqueue.py
                    env.channel.send(BATCH_DOORBELL)
            env.channel.send(PassEnd(message.number))
