"""``pin_memory`` and ``device``: pinned reader rings, batches moved to the GPU, ring slots released after the copy.

NOTE [ GPU placement ]
A reader's ring is mapped once in the trainer. With ``pin_memory=True`` or a CUDA ``device`` the trainer registers
that mapping with CUDA (``cudaHostRegister``, portable) when the ring arrives (``RingReady``), not on a batch, and
unregisters it at close. Every CUDA call runs under a device guard for the rank's own GPU, as torch's pin thread
sets the device first: ``cudaHostRegister`` makes a context on the current device, and a rank that never called
``set_device`` would otherwise put one (a few hundred MB) on GPU 0. The rank's own GPU (``own_gpu``) is ``cuda:0``
when the rank sees one GPU (``CUDA_VISIBLE_DEVICES`` per rank), else ``cuda:{local_rank}``, whatever device is
current; where ``local_rank`` is past the GPUs it sees, ``device="cuda"`` is refused as ambiguous and pin-only
registers on the device current when the first ring arrives (the rank's ``set_device``).

A host-to-device copy out of a pinned ring is a DMA that runs after the call that enqueued it returns, so a ring
slot goes back to its reader (which overwrites it) only once the copies that read it are done: each delivered
batch has a ticket, pending once its CPU views died, released when its CUDA event has completed
(``ReleaseQueue``). An event completes when the stream it was recorded on passes it, so it must be recorded on the
stream that runs the copies: one recorded on an idle stream completes at once and the slot is overwritten under
the DMA (torn or repeated rows, no error).

* ``device="cuda:N"``: the loader makes the copy itself, on its own copy stream of that device (NOTE [ The copy
  stream ] in cudaops.py: made by the loader, non-blocking, high priority; not one of torch's pool): one copy of
  the slot's field bytes (one contiguous block), device-side views per field, ``INDEX_KEY`` cloned on the CPU (it
  goes back to ``evict``, which would otherwise sync). The event is recorded on the copy stream after the copy.
  The consumer of the batch is the current stream of that device in the thread that calls ``next()``, at that
  call (``torch.cuda.current_stream()``; inside ``with torch.cuda.stream(s)``, ``s``): it waits on the copy stream
  and ``record_stream`` tells the allocator that it uses the batch. Work on any other stream must first wait on
  that one (``other.wait_stream(torch.cuda.current_stream())`` right after ``next()``, and
  ``t.record_stream(other)``), as for any tensor torch hands over; a prefetch thread that calls ``next()`` makes
  the compute stream current there. The copy overlaps the compute already queued; nothing waits on the host.
* Every exception path returns the slot: a hand-over that raises (the copy's CUDA OOM, an interrupt, any error
  after the copy was queued) drops its ticket with an event recorded on the copy stream after whatever was queued
  there (no event at all if no copy was ever queued), so a catch-and-retry loop never starves its readers and a
  slot is never refilled under a copy that was queued before the failure.
* ``pin_memory=True`` alone: the caller gets the pinned CPU views and copies them itself, on streams the loader
  cannot see. When the views die the loader records, at its next ``poll``, one event on the current stream of
  every device that has a context in this process, and on each stream named by ``release_after`` (a prefetcher's
  side stream), so a copy enqueued on any of them before the drop is covered, ``set_device`` or not. A copy on
  another stream must be ordered onto the current stream before the drop:
  ``torch.cuda.current_stream().wait_stream(side)`` or ``side.synchronize()``.
* No pageable hand-out in pin-only mode: a reader's slot whose event is pending is waited for (the oldest copy)
  rather than handing out a CPU clone; when the caller itself holds the rest of the ring (``for batch in
  loader`` holds the previous batch, the whole of a 2-deep ring's spare), the copy it gets is in page-locked memory
  of torch's caching host allocator, so its ``non_blocking`` copy stays a DMA.
* ``close()`` waits only on the loader's own events, until ``CLOSE_WAIT_S``: the event after its latest copy
  (device mode), or one recorded at close on the streams above (pin-only: a batch the caller still holds may be
  copying), then the pending slots'. Never a device synchronize: it would also wait for a collective stuck on a
  dead rank, at interpreter exit too. If the deadline passes, the rings stay registered and mapped for the life
  of the process (a copy still running reads valid memory), with a warning. A failed register or unregister
  clears CUDA's error state in the runtime torch calls (it would surface at the user's next kernel launch), warns
  once with the error's name; a ring that failed to register stays pageable (copies still correct, slower), one
  that failed to unregister keeps its mapping for the life of the process (a new mapping at that address would
  fail as already registered).
Rings of readers that died and were respawned stay registered until close (at most ``max_restarts`` per reader).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from gigashuffle.config import DataloaderConfig
from gigashuffle.shm.ring import BatchRing
from gigashuffle.trainer.cudaops import CudaOps, Event
from gigashuffle.trainer.devicecopies import DeviceCopies
from gigashuffle.trainer.devices import _cuda_missing, own_gpu, resolve_device
from gigashuffle.trainer.pinonly import PinOnlyEvents
from gigashuffle.trainer.placement import Batch, Placement
from gigashuffle.trainer.releases import ReleaseQueue

log = logging.getLogger(__name__)

# How long close() waits for copies out of the rings before it gives up and leaves them registered (NOTE).
CLOSE_WAIT_S = 10.0
# Ranges whose unregister failed: their mappings must outlive this process's use of them (see the NOTE).
_STILL_REGISTERED: list[torch.Tensor] = []


class CudaPlacement(DeviceCopies, PinOnlyEvents):
    """Rings registered with CUDA; with ``moves``, batches copied to GPU ``index`` (NOTE [ GPU placement ]).
    ``index`` None: the current device when the first ring arrives (pin-only, see ``own_gpu``)."""

    tracks = True

    def __init__(self, cuda: CudaOps, index: int | None, moves: bool) -> None:
        self.cuda = cuda
        self._index = index  # the rank's own GPU: every CUDA call below runs under a guard for it
        self.moves = moves
        self.releases = ReleaseQueue(self._pin_only_event)
        # id(ring.memory) -> (ring.memory, the registered range or None if the register failed). Holding the memory
        # keeps its id from being reused by the ring of a respawned reader, which must be registered too.
        self._rings: dict[int, tuple[object, torch.Tensor | None]] = {}
        self._copy_stream: object | None = None
        # The event recorded after the latest copy on the copy stream: it covers every earlier one (close waits on it).
        self._copied: Event | None = None
        self._side_streams: list[object] = []  # release_after(): the caller's streams that copy out of the rings
        self._warned: set[str] = set()
        self._closed = False

    @property
    def index(self) -> int:
        if self._index is None:
            self._index = self.cuda.current_device_index()
        return self._index

    @property
    def pending(self) -> int:
        return self.releases.pending

    def adopt(self, ring: BatchRing) -> None:
        key = id(ring.memory)
        if key in self._rings:
            return
        anchor = ring.memory.view(0, ring.nbytes)  # keeps the mapping alive for as long as it is registered
        with self.cuda.guard(self.index):
            code = self.cuda.host_register(anchor.data_ptr(), ring.nbytes)
            if code != 0:
                self._failed("register", code, f"a reader ring ({ring.nbytes} bytes) stays pageable: copies out of "
                             "it are staged by CUDA (slower). Raise the locked-memory limit (ulimit -l) or lower "
                             "ring_depth or bs")  # fmt: skip
        self._rings[key] = (ring.memory, anchor if code == 0 else None)

    def _failed(self, what: str, code: int, consequence: str) -> None:
        """Clear the error a failed runtime call left set (the user's next launch would raise it), warn once."""
        self.cuda.clear_error(self.index)
        if what not in self._warned:
            self._warned.add(what)
            log.warning("cudaHost%s failed on cuda:%d: %s; %s", what.capitalize(), self.index,
                        self.cuda.error_name(code), consequence)  # fmt: skip

    def deliver(self, ring: BatchRing, k: int, release: Callable[[], None]) -> Batch:
        if id(ring.memory) not in self._rings:
            release()  # never handed out: the slot goes back as it is
            raise AssertionError("a batch of a ring that never arrived through RingReady")
        ticket = self.releases.ticket(release)
        if not self.moves:
            return ring.batch(k, ticket.dropped)
        started = time.perf_counter()
        copied = False
        try:
            batch = self._copy(ring, k, ticket)
            copied = True
        finally:
            # Every way out drops the ticket once: the caller never holds ring memory. A failed copy (CUDA OOM) or
            # an interrupt gets an event after whatever was queued on the copy stream, since that may read the slot
            # (NOTE [ GPU placement ], "every exception path").
            if not copied:
                ticket.event = self._fence()
            ticket.dropped()  # pending now, released once the event completes
        self.h2d_s += time.perf_counter() - started
        self.h2d_copies += 1
        return batch

    def poll(self, wait: bool = False) -> int:
        return self.releases.poll(wait)

    def clone(self, batch: Batch) -> Batch:
        if self.moves:
            return super().clone(batch)
        # Pin-only: a clone in pageable memory would make the caller's next non_blocking copy a staged, synchronous
        # one; torch's pinned host allocator keeps it a DMA (and reuses a block only after its copies ran).
        try:
            with self.cuda.guard(self.index):
                return [{key: self.cuda.pinned_clone(t) for key, t in group.items()} for group in batch]
        except RuntimeError as exc:  # out of page-locked memory: correct, slower
            self.cuda.clear_error(self.index)
            if "pinned clone" not in self._warned:
                self._warned.add("pinned clone")
                log.warning("a batch handed out as a copy could not be pinned (%s); such copies stay pageable", exc)
            return super().clone(batch)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Errors are logged, not raised: this runs in the loader's finalizer too, possibly at interpreter exit when
        # CUDA is already torn down, and the processes must still be stopped after it.
        settled = False
        try:
            settled = self._settle(time.monotonic() + CLOSE_WAIT_S)
        except Exception as exc:
            log.warning("could not wait for the copies out of the reader rings: %s", exc)
        if self._rings and not settled:
            log.warning(
                "copies out of the reader rings did not complete within %.0f s at close (a GPU busy with a "
                "collective that waits for a dead rank?): the rings stay registered and mapped for the life of "
                "this process, so that a copy still running reads valid memory",
                CLOSE_WAIT_S,
            )
        for _memory, anchor in self._rings.values():
            if anchor is None:
                continue
            if settled:
                self._unregister(anchor)
            else:
                _STILL_REGISTERED.append(anchor)
        self._rings.clear()

    def _settle(self, deadline: float) -> bool:
        """Wait, until ``deadline``, only on the loader's own events: those after its copies (device mode), or one
        recorded now on the streams the caller's copies run on (pin-only: a batch the caller still holds may be
        copying), then the pending slots'. Never a device synchronize: it would wait for every stream of the
        device, a collective stuck on a dead rank included. Whether everything that may read a ring is done."""
        if not self._rings:
            return True
        fence = self._copied if self.moves else self._pin_only_event()
        if fence is not None and not self.cuda.wait(fence, max(0.0, deadline - time.monotonic())):
            return False
        while True:
            self.releases.poll()
            if not self.releases.pending:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.01, left))

    def _unregister(self, anchor: torch.Tensor) -> None:
        try:
            with self.cuda.guard(self.index):
                code = self.cuda.host_unregister(anchor.data_ptr())
                if code != 0:
                    _STILL_REGISTERED.append(anchor)
                    self._failed("unregister", code, "the ring's mapping is kept for the life of this process")
        except Exception as exc:
            _STILL_REGISTERED.append(anchor)
            log.warning("could not unregister a reader ring from CUDA: %s", exc)


def placement(config: DataloaderConfig, cuda: CudaOps | None = None) -> Placement:
    """The placement ``config`` asks for, checked against this machine (ValueError naming the field if it lacks
    CUDA). Called before the loader starts anything; makes no CUDA context."""
    cuda = cuda or CudaOps()
    device = resolve_device(config, cuda)
    if config.pin_memory and not cuda.is_available():
        raise _cuda_missing(
            "pin_memory", True, "set pin_memory=False (batches stay in shared CPU memory) or run on a GPU machine"
        )
    if device is not None and device.type == "cuda":
        return CudaPlacement(cuda, device.index or 0, moves=True)
    if config.pin_memory:
        # The guard's device for registering rings: the rank's own GPU, as for device="cuda"; where that rule has
        # no answer, the device the rank made current (set_device) by the time its first ring arrives, never a
        # guess such as local_rank % device_count, which puts a context on another rank's GPU.
        return CudaPlacement(cuda, own_gpu(config.local_rank, cuda.device_count()), moves=False)
    return Placement()


__all__ = [
    "CLOSE_WAIT_S",
    "Batch",
    "CudaPlacement",
    "Placement",
    "own_gpu",
    "placement",
    "resolve_device",
]
