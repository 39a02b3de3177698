"""The reader loop: gather random full slots into the ring, tell the trainer which ring slot is ready.

NOTE [ Reader cycle ]
The trainer maps the reader's ring (its fd crosses once, at start); per batch only ``("batch", k)`` and later
``("free", k)`` cross the channel. Steady state is one round trip per batch: ``READER_CYCLE`` returns the slots
of batch ``i`` (to empty, or to full when evict_on_read=False) and leases batch ``i + 1``. Batch ``i`` is
announced only after that call, so a reader killed at any point never lets a delivered sample be read again.
The reader asks for a new batch only while it has a free ring slot, so a reader blocked on a slow trainer
holds no slots and cannot starve the rest of the node. Up to ``ring_depth`` batches are in flight.

With fill_once=True the reader waits for a full buffer, then gathers this rank's share of the slots in slot
order, once per pass the trainer asks for, leasing nothing.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np
import torch

from .buffer import BatchRing, SlotBuffer
from .channel import Channel
from .slots import SlotIds
from .workers import Backoff, ChildEnv, ChildSpec

log = logging.getLogger(__name__)

_NO_SLOTS: SlotIds = np.empty(0, dtype=np.int32)
_IDLE_POLL_S = 0.5


def _open_ring(env: ChildEnv) -> tuple[SlotBuffer, BatchRing]:
    layout = env.attach_buffer()
    if env.buffer is None:
        raise AssertionError("reader has no buffer after attach")
    ring = BatchRing(layout, env.config.bs, env.config.ring_depth)
    fd = ring.memory.fd
    if fd is None:
        raise AssertionError("a new ring has no fd")
    env.channel.send(("ring", ring.nbytes, layout.to_json()), (fd,))
    ring.memory.close_fd()
    return env.buffer, ring


def _gather(buffer: SlotBuffer, ring: BatchRing, k: int, slots: SlotIds) -> None:
    fields, index = ring.regions(k)
    ids = torch.from_numpy(slots.astype(np.int64))
    buffer.gather(ids, fields)
    index.copy_(ids)


def _take_frees(env: ChildEnv, free: deque[int], block_s: float) -> list[tuple[object, ...]]:
    """Collect ``free`` messages (waiting up to ``block_s`` for the first); return any other messages."""
    others = []
    timeout = block_s
    while env.channel.poll(timeout):
        message, _ = env.channel.recv()
        if message[0] == "free":
            free.append(message[1])
        else:
            others.append(message)
        timeout = 0
    return others


def run(spec: ChildSpec, channel: Channel) -> None:
    env = ChildEnv(spec, channel)
    buffer, ring = _open_ring(env)
    if spec.config.fill_once:
        _serve_passes(env, buffer, ring)
    else:
        _stream(env, buffer, ring)


def _stream(env: ChildEnv, buffer: SlotBuffer, ring: BatchRing) -> None:
    cfg = env.config
    free: deque[int] = deque(range(ring.depth))
    backoff = Backoff()
    done = _NO_SLOTS  # slots gathered into the ring, not yet returned to Redis
    ready: int | None = None  # ring slot gathered, announced after its slots are returned
    while True:
        _take_frees(env, free, 0 if (free or ready is not None) else _IDLE_POLL_S)
        if not free and ready is None:
            continue
        want = cfg.bs if free else 0
        slots = env.store.reader_cycle(env.proc, done, want, cfg.min_full_slots, cfg.evict_on_read)
        done = _NO_SLOTS
        if ready is not None:
            env.channel.send(("batch", ready))
            ready = None
        if len(slots) == 0:
            if want:
                backoff.sleep()
            continue
        backoff.reset()
        while not free:  # slots came back from a lost reply while the ring is full: wait for room
            _take_frees(env, free, _IDLE_POLL_S)
        k = free.popleft()
        _gather(buffer, ring, k, slots)
        done, ready = slots, k


def _serve_passes(env: ChildEnv, buffer: SlotBuffer, ring: BatchRing) -> None:
    cfg = env.config
    backoff = Backoff(cap_s=0.05)
    while env.store.stats()[1] < cfg.shuffle_size:
        backoff.sleep()
    per_rank = cfg.shuffle_size // cfg.local_world_size
    first = cfg.local_rank * per_rank
    order = np.arange(first, first + per_rank, dtype=np.int32)
    batches = per_rank // cfg.bs
    free: deque[int] = deque(range(ring.depth))
    while True:
        for message in _take_frees(env, free, _IDLE_POLL_S):
            if message[0] != "pass":
                continue
            for b in range(batches):
                while not free:
                    _take_frees(env, free, _IDLE_POLL_S)
                k = free.popleft()
                _gather(buffer, ring, k, order[b * cfg.bs : (b + 1) * cfg.bs])
                env.channel.send(("batch", k))
            env.channel.send(("end", message[1]))
