"""Ring slots whose copies may still run: each released once the CUDA event covering its copies has completed
(NOTE [ GPU placement ] in pinning.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from gigashuffle.procs.interrupts import critical
from gigashuffle.shm import buffer
from gigashuffle.trainer.cudaops import Event


class Ticket:
    """One delivered ring slot: ``dropped`` runs once its CPU views are gone (from ``buffer.reclaim()``, in a
    section: NOTE [ Reclaimed ring slots ] in shm/ring.py) or, for a device copy, at once."""

    __slots__ = ("_dropped", "event", "release")

    def __init__(self, release: Callable[[], None], dropped: deque[Ticket]) -> None:
        self.event: Event | None = None
        self.release = release
        self._dropped = dropped

    def dropped(self) -> None:
        self._dropped.append(self)


class ReleaseQueue:
    """Ring slots whose batches are gone, each released once the event that covers its copies has completed.
    ``new_event`` makes the event of a ticket that has none when it becomes pending (pin_memory alone; None: no
    copy can be in flight)."""

    def __init__(self, new_event: Callable[[], Event | None]) -> None:
        self._new_event = new_event
        self._dropped: deque[Ticket] = deque()
        self._pending: deque[Ticket] = deque()

    def ticket(self, release: Callable[[], None]) -> Ticket:
        return Ticket(release, self._dropped)

    @property
    def pending(self) -> int:
        """Slots whose batches are gone but not yet released (their copies may still run)."""
        return len(self._pending) + len(self._dropped)

    def _collect(self) -> None:
        buffer.reclaim()  # the tickets of pinned batches whose views died since: NOTE [ Reclaimed ring slots ]
        shared: list[Event | None] = []  # one event covers every batch dropped before it is recorded
        while self._dropped:
            ticket = self._dropped.popleft()
            if ticket.event is None:
                # pin_memory alone: the caller's copies were enqueued before it dropped the views.
                if not shared:
                    shared.append(self._new_event())
                ticket.event = shared[0]
            self._pending.append(ticket)

    def poll(self, wait: bool = False) -> int:
        """Release every slot whose copies are done; with ``wait``, block for the oldest if none is. Returns how
        many were released."""
        # One section: a ticket released and still in _pending would be released twice (NOTE [ Ctrl-C ]).
        with critical():
            return self._poll(wait)

    def _poll(self, wait: bool) -> int:
        self._collect()
        released = 0
        waiting: deque[Ticket] = deque()
        for ticket in self._pending:
            if ticket.event is not None and not ticket.event.query():
                waiting.append(ticket)
                continue
            ticket.release()
            released += 1
        self._pending = waiting
        if wait and not released and self._pending:
            ticket = self._pending.popleft()
            if ticket.event is not None:
                ticket.event.synchronize()
            ticket.release()
            released = 1
        return released

    def drain(self) -> None:
        """Wait for every pending copy and release its slot (at close: memory must not be unmapped under a DMA)."""
        with critical():
            self._collect()
            while self._pending:
                ticket = self._pending.popleft()
                if ticket.event is not None:
                    ticket.event.synchronize()
                ticket.release()


class AllOf:
    """Done when every event is (pin_memory alone: one event per device with a context)."""

    def __init__(self, events: list[Event]) -> None:
        self.events = events

    def query(self) -> bool:
        return all(event.query() for event in self.events)

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()
