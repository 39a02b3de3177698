"""The ring slots of batches the caller dropped, on their way back to the readers that wrote them.

NOTE [ Batched frees ]
A delivered batch is a set of views into one slot ``k`` of its reader's ring; when the caller drops the last of
them, a finalizer (any thread, so it only appends to a deque) records ``(child, k)``. The trainer thread drains
that record: the child's ``held`` count falls at once (the copies fallback in the loader reads it), and ``k`` joins
the child's unsent slots. Sending them is what costs: a ``FreeSlot`` is a send for the trainer and a wakeup and a
receive for the reader, and one per batch was a tenth of the trainer's CPU on token rows. So:
  * while a batch is ready, the trainer returns a reader's slots once half its ring waits to go back
    (``frees_per_message``): the reader keeps the other half to draw into, and gets its slots in one message;
  * whenever the trainer is about to wait (no batch ready, every pump, a pass that ends), it sends them all.
A reader therefore never waits for a slot the trainer keeps while the trainer waits for a batch: there is no
deadlock to construct, and the delay a reader sees is bounded by the batches the trainer had in hand anyway.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterator

from gigashuffle.procs import interrupts
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.shm import buffer

# The weakref callback that runs ``release_later``'s partial when a batch's last view dies, at any bytecode of the
# caller: a Ctrl-C in it would lose the ring slot (NOTE [ Ctrl-C ] in procs/interrupts.py). shm/buffer.py exports no
# name for it, so it is named here.
interrupts.protect(buffer._released.__code__)


def frees_per_message(ring_depth: int) -> int:
    """How many of a reader's ring slots go back in one message while the trainer has batches in hand."""
    return max(1, ring_depth // 2)


class DroppedBatches:
    """The ring slots of dropped batches, by reader, until the trainer sends them back (NOTE [ Batched frees ])."""

    def __init__(self) -> None:
        self._dropped: deque[tuple[ChildProcess, int]] = deque()  # appended by batch finalizers, on any thread
        self._unsent: dict[int, ChildProcess] = {}  # id(child) -> a child with slots in child.unsent

    def release_later(self, child: ChildProcess, k: int) -> Callable[[], None]:
        """The finalizer of a batch in ring slot ``k`` of ``child``: a C call with no Python frame of its own, so
        no Ctrl-C can land between its start and the append (NOTE [ Ctrl-C ] in procs/interrupts.py)."""
        return functools.partial(self._dropped.append, (child, k))

    def due(self, *, everything: bool) -> Iterator[tuple[ChildProcess, list[int]]]:
        """Drain the dropped batches; yield each reader's slots that are due to go back now (all of them, with
        ``everything``), in one list per reader. The caller runs the whole loop in one ``critical()`` section: a
        slot popped here and not yet sent is in no list."""
        dropped = self._dropped
        while dropped:
            child, k = dropped.popleft()
            child.held -= 1
            child.unsent.append(k)
            self._unsent[id(child)] = child
        for key, child in list(self._unsent.items()):
            if everything or child.ring is None or len(child.unsent) >= frees_per_message(child.ring.depth):
                ks, child.unsent = child.unsent, []
                del self._unsent[key]
                yield child, ks

    def clear(self) -> None:
        self._dropped.clear()
        for child in self._unsent.values():
            child.unsent = []
        self._unsent.clear()
