"""``pin_memory`` and ``device``: pinned reader rings, batches moved to the GPU, ring slots released after the copy.

NOTE [ Pinned rings ]
A reader's ring is mapped once in the trainer; with ``pin_memory=True`` or a CUDA ``device`` the trainer registers
that mapping with CUDA (``cudaHostRegister``, as ``torch.cuda._pin_memory_utils`` does) the first time it delivers
a batch from it, and unregisters it at close. Batches are still zero-copy views of the ring, now in page-locked
memory, so a ``non_blocking`` host-to-device copy is a DMA straight out of the ring with no staging copy.

That DMA runs after the call that enqueued it returns, so a ring slot must not go back to its reader (which would
overwrite it) when the batch's CPU views die, but only once the copy that reads them has finished. Each delivered
batch therefore gets a ticket: when its views die the ticket becomes pending, a CUDA event stands for "every copy
that read it is done", and the slot is released once ``event.query()`` says so (``ReleaseQueue``).

* With ``device="cuda:N"`` the loader makes the copies itself (``non_blocking=True``, on the device's current
  stream) and records the event right after them; the caller gets device tensors and the CPU views die at once.
* With ``pin_memory=True`` alone the caller gets the pinned CPU views and copies them itself. The event is recorded
  on the current stream after the views died, which orders it after every copy the caller enqueued on that stream
  before dropping the batch; a copy on another stream must be waited for by the caller before dropping the batch.

Copies run on the current stream, so they queue behind the GPU work the trainer enqueued before asking for the
batch; a side stream for prefetching is not done here. Rings of readers that died and were respawned stay
registered until close (at most ``max_restarts`` of them per reader).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from gigashuffle.config import DataloaderConfig
from gigashuffle.errors import GigashuffleError
from gigashuffle.procs import interrupts
from gigashuffle.procs.interrupts import critical
from gigashuffle.shm.buffer import BatchRing

log = logging.getLogger(__name__)

Batch = list[dict[str, torch.Tensor]]
_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, as torch's own pin_memory util registers


class Event(Protocol):
    """What ``ReleaseQueue`` needs of a ``torch.cuda.Event``."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Ticket:
    """One delivered ring slot: ``dropped`` is the finalizer of its CPU views (it may run in any thread)."""

    __slots__ = ("_dropped", "event", "release")

    def __init__(self, release: Callable[[], None], dropped: deque[Ticket]) -> None:
        self.event: Event | None = None
        self.release = release
        self._dropped = dropped

    def dropped(self) -> None:
        self._dropped.append(self)  # deque.append is atomic: nothing else is safe in a finalizer of any thread


# A batch's views may die at any bytecode of the main thread: NOTE [ Ctrl-C ] in procs/interrupts.py.
interrupts.protect(Ticket.dropped.__code__)


class ReleaseQueue:
    """Ring slots whose batches are gone, each released once the event that covers its copies has completed."""

    def __init__(self, new_event: Callable[[], Event]) -> None:
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
        while self._dropped:
            ticket = self._dropped.popleft()
            if ticket.event is None:
                # pin_memory without device: the caller's copies were enqueued before it dropped the views.
                ticket.event = self._new_event()
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


class Placement:
    """Where batches go: ``device=None`` or ``"cpu"`` without pinning hands out the ring's views as they are."""

    tracks = False  # whether ring slots are released through a ReleaseQueue
    moves = False  # whether batches are copied to a device (the caller then never holds ring memory)

    @property
    def pending(self) -> int:
        return 0

    def deliver(self, ring: BatchRing, k: int, release: Callable[[], None]) -> Batch:
        return ring.batch(k, release)

    def poll(self, wait: bool = False) -> int:
        return 0

    def place(self, batch: Batch) -> Batch:
        """``batch`` (the caller's own memory, e.g. the dummy batch) where delivered batches go."""
        return batch

    def close(self) -> None:
        """Release what is left; safe to call twice."""


class TrackedPlacement(Placement):
    """Pinned rings and event-gated releases; subclasses say how to pin, move and make an event."""

    tracks = True

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.moves = device is not None
        self.releases = ReleaseQueue(self.new_event)
        # id(ring.memory) -> (ring.memory, undo): holding the memory object keeps its id from being reused by the
        # ring of a respawned reader, which must be pinned too.
        self._unpin: dict[int, tuple[object, Callable[[], None]]] = {}
        self._closed = False

    # What a machine provides: pinning a ring (returning how to undo it), moving a batch, and an event.
    def pin(self, ring: BatchRing) -> Callable[[], None]:
        raise NotImplementedError

    def move(self, views: Batch) -> Batch:
        raise NotImplementedError

    def new_event(self) -> Event:
        raise NotImplementedError

    @property
    def pending(self) -> int:
        return self.releases.pending

    def deliver(self, ring: BatchRing, k: int, release: Callable[[], None]) -> Batch:
        key = id(ring.memory)
        if key not in self._unpin:
            self._unpin[key] = (ring.memory, self.pin(ring))
        ticket = self.releases.ticket(release)
        views = ring.batch(k, ticket.dropped)
        if self.device is None:
            return views
        try:
            return self.move(views)
        finally:
            # Recorded after the copies were enqueued, before the views die and make the ticket pending.
            ticket.event = self.new_event()

    def poll(self, wait: bool = False) -> int:
        return self.releases.poll(wait)

    def place(self, batch: Batch) -> Batch:
        return batch if self.device is None else self.move(batch)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Errors are logged, not raised: this runs in the loader's finalizer too, possibly at interpreter exit when
        # CUDA is already torn down, and the processes must still be stopped after it.
        try:
            self.releases.drain()
        except Exception as exc:
            log.warning("could not wait for the copies out of the reader rings: %s", exc)
        for _memory, unpin in self._unpin.values():
            try:
                unpin()
            except Exception as exc:
                log.warning("could not unregister a reader ring from CUDA: %s", exc)
        self._unpin.clear()


class CudaPlacement(TrackedPlacement):
    """Rings registered with ``cudaHostRegister``; batches copied to ``device`` with ``non_blocking=True``."""

    def pin(self, ring: BatchRing) -> Callable[[], None]:
        anchor = ring.memory.view(0, ring.nbytes)  # keeps the mapping alive for as long as it is registered
        ptr = anchor.data_ptr()
        code = int(_cudart().cudaHostRegister(ptr, ring.nbytes, _CUDA_HOST_REGISTER_PORTABLE))
        if code != 0:
            raise GigashuffleError(
                f"cudaHostRegister of a reader ring ({ring.nbytes} bytes) failed: {torch.cuda.CudaError(code)}. "
                "The locked-memory limit (ulimit -l) or the container may forbid pinning; raise it, lower "
                "ring_depth or bs, or set DataloaderConfig.pin_memory=False and device=None"
            )

        def unpin() -> None:
            result = int(_cudart().cudaHostUnregister(anchor.data_ptr()))
            if result != 0:
                raise torch.cuda.CudaError(result)

        return unpin

    def move(self, views: Batch) -> Batch:
        return [{key: t.to(self.device, non_blocking=True) for key, t in group.items()} for group in views]

    def new_event(self) -> Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        # pin_memory alone: the caller copies on the current stream of whatever device is current when it drops the
        # batch, which need not be the device that was current when the loader was built.
        event.record(torch.cuda.current_stream(self.device))
        return event


def _cudart() -> Any:
    """The CUDA runtime bindings torch ships (``torch.cuda.cudart()``; it initialises CUDA in this process)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _cuda_missing(field: str, value: object, fix: str) -> ValueError:
    why = (
        "this torch is built without CUDA"
        if torch.version.cuda is None
        else "torch.cuda.is_available() is False (no GPU visible: check CUDA_VISIBLE_DEVICES and the driver)"
    )
    return ValueError(f"DataloaderConfig.{field}={value!r} needs CUDA, but {why} (torch {torch.__version__}); {fix}")


def resolve_device(config: DataloaderConfig) -> torch.device | None:
    """The device batches go to (None: they stay in the ring); ValueError if this machine lacks it."""
    if config.device is None:
        return None
    device = torch.device(config.device)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise _cuda_missing(
            "device", config.device, "install a CUDA build of torch and run on a GPU machine, or use device='cpu'"
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"DataloaderConfig.device={config.device!r} is invalid: this machine has {torch.cuda.device_count()} "
            "visible GPUs; use device=f'cuda:{LOCAL_RANK}' with a LOCAL_RANK below that"
        )
    return torch.device("cuda", index)


def placement(config: DataloaderConfig) -> Placement:
    """The placement ``config`` asks for, checked against this machine (ValueError naming the field if it lacks
    CUDA). Called before the loader starts anything."""
    device = resolve_device(config)
    if config.pin_memory and not torch.cuda.is_available():
        raise _cuda_missing(
            "pin_memory", True, "set pin_memory=False (batches stay in shared CPU memory) or run on a GPU machine"
        )
    if device is not None and device.type == "cuda":
        return CudaPlacement(device)
    if config.pin_memory:
        return CudaPlacement(None)
    return Placement()
