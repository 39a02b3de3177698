"""``SlotQueue``: ring slot numbers passed one way between a reader and its trainer, in the ring's shared memory.

NOTE [ Slot queues ]
A reader's ring slots go to the trainer when the reader announces the batches gathered into them, and back when the
caller has dropped those batches. Both ways are a ``SlotQueue`` in the ring itself, not a message per batch: a send
and its receive were among the largest items of the trainer's and the reader's CPU per batch (docs/benchmarks.md).
- One producer and one consumer. The ``n``-th slot put is written as one int64 word, ``n << 20 | k``, into cell
  ``(n - 1) % depth``; the consumer takes in order and knows the ``n``-th has come when its cell holds ``n``. One
  aligned 8-byte store is seen whole or not at all on every CPU we run on, so no second word (a head index) has to
  be ordered against it.
- A cell is free to overwrite: a slot is in one place at a time, so when the producer puts its ``n``-th, every other
  slot put and not yet taken is one of at most ``depth - 1``, and the consumer takes in order: put ``n - depth`` was
  taken.
- Only a consumer about to block needs a wake-up. It stores in the queue's ``waits`` word the put count at which it
  wants one (``wake_at``), takes again, and only then waits on its channel; the producer, after its stores, sends a
  doorbell message if its count reached the number it reads there (0: nobody waits). The trainer wants every
  announcement at once (the next put). A reader with no free slot wants ``slots_per_wake(depth)``, half its ring:
  with a training step between batches the trainer holds the whole ring and gives one slot back per step, and a
  doorbell per slot was a send for the trainer and a wake-up for the reader per batch. Half the ring leaves the
  trainer half a ring of batches while the reader refills. A trainer about to block for a batch first rings every
  reader that waits for slots, whatever it asked for (``Inbox.expect_announcements``): the slots it has are the
  trainer's next batches. Each side
  stores and then loads the other's word, and a CPU may order that load first (x86 and Arm both may), so both can
  miss each other. A reader waiting for a slot therefore takes again every ``RECHECK_S``; the trainer's pump waits
  ``RECHECK_S`` at first and twice as long after each pump that found nothing, up to its own 250 ms (a trainer left
  waiting wakes 4 times a second, not 100). A missed doorbell costs one such wait, once; never a hang.
- What the consumer takes must be as visible as the messages that follow it: the trainer takes a reader's
  announcements before each message it reads from that reader (a ``Paused`` for a checkpoint's cut, a ``PassEnd``),
  and the reader's stores came before its send. The trainer may see an announcement earlier than the message that
  follows it, never later.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

_SHIFT = 20
_SLOT = (1 << _SHIFT) - 1
RECHECK_S = 0.01  # a waiting reader takes again this often; a waiting trainer at first


def slots_per_wake(depth: int) -> int:
    """How many slots given back wake a reader that has none (NOTE [ Slot queues ]): half its ring."""
    return max(1, depth // 2)


def queue_bytes(depth: int) -> int:
    """Bytes of one queue of a ring of ``depth`` slots: its cells and its ``waits`` word."""
    return 8 * (depth + 1)


class SlotQueue:
    """One way of a ring's slots (NOTE [ Slot queues ]) over ``words``, ``queue_bytes(depth)`` of the ring's shared
    memory; each process counts its own side (the puts it made, or the puts it took) in a private attribute."""

    def __init__(self, words: np.ndarray[Any, np.dtype[np.int64]], depth: int) -> None:
        self._cells = words[:depth]
        # The put count at which the waiting consumer wants a doorbell; 0 while it does not wait (``wake_at``).
        self.waits = words[depth : depth + 1]
        self._depth = depth
        self._put = 0  # producer: slots put so far
        self._taken = 0  # consumer: puts taken so far

    def put(self, ks: Iterable[int]) -> bool:
        """Producer: pass ring slots ``ks`` on, in this order; whether the consumer waits and needs a doorbell."""
        cells, depth, n = self._cells, self._depth, self._put
        for k in ks:
            n += 1
            cells[(n - 1) % depth] = (n << _SHIFT) | k
        self._put = n
        wanted = int(self.waits[0])
        return wanted != 0 and n >= wanted

    def wake_at(self, more: int) -> None:
        """Consumer, about to block: ask for a doorbell once ``more`` puts past those taken have come (then take
        again before blocking: NOTE [ Slot queues ])."""
        self.waits[0] = self._taken + more

    def stop_waiting(self) -> None:
        """Consumer: awake again; no put needs a doorbell."""
        self.waits[0] = 0

    def has_puts(self) -> bool:
        """Consumer: whether a put waits to be taken (what ``take()`` would find first), without taking it."""
        n = self._taken + 1
        return int(self._cells[(n - 1) % self._depth]) >> _SHIFT == n

    def take(self) -> list[int]:
        """Consumer: the slots put since the last take, in the order they were put."""
        cells, depth = self._cells, self._depth
        n = self._taken + 1
        taken: list[int] = []
        while True:
            word = int(cells[(n - 1) % depth])
            if word >> _SHIFT != n:  # not put yet: the cell holds the put ``depth`` before it
                break
            taken.append(word & _SLOT)
            n += 1
        self._taken = n - 1
        return taken
