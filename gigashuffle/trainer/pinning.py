"""``pin_memory`` and ``device``: pinned reader rings, batches moved to the GPU, ring slots released after the copy.

NOTE [ GPU placement ]
A reader's ring is mapped once in the trainer. With ``pin_memory=True`` or a CUDA ``device`` the trainer registers
that mapping with CUDA (``cudaHostRegister``, portable) when the ring arrives (``RingReady``), not on a batch, and
unregisters it at close. Every CUDA call runs under a device guard for the rank's own GPU, as torch's pin thread
sets the device first: ``cudaHostRegister`` makes a context on the current device, and a rank that never called
``set_device`` would otherwise put one (a few hundred MB) on GPU 0. ``device="cuda"`` is that GPU: ``cuda:0`` when
the rank sees one GPU (``CUDA_VISIBLE_DEVICES`` per rank), else ``cuda:{local_rank}``, whatever device is current.

A host-to-device copy out of a pinned ring is a DMA that runs after the call that enqueued it returns, so a ring
slot goes back to its reader (which overwrites it) only once the copies that read it are done: each delivered
batch has a ticket, pending once its CPU views died, released when its CUDA event has completed
(``ReleaseQueue``). An event completes when the stream it was recorded on passes it, so it must be recorded on the
stream that runs the copies: one recorded on an idle stream completes at once and the slot is overwritten under
the DMA (torn or repeated rows, no error).

* ``device="cuda:N"``: the loader makes the copy itself, on a copy stream of its own on that device: one copy of
  the slot's field bytes (one contiguous block), device-side views per field, ``INDEX_KEY`` cloned on the CPU (it
  goes back to ``evict``, which would otherwise sync). The event is recorded on the copy stream after the copy; the
  device's current (compute) stream waits on the copy stream and ``record_stream`` tells the allocator that the
  compute stream uses the batch. The copy overlaps the compute already queued; nothing waits on the host.
* ``pin_memory=True`` alone: the caller gets the pinned CPU views and copies them itself, on streams the loader
  cannot see. When the views die the loader records, at its next ``poll``, one event on the current stream of
  every device that has a context in this process, so a copy enqueued before the drop on the current stream of
  any device, ``set_device`` or not, is covered. A copy on another stream (a prefetcher's side stream) must be
  ordered before the drop onto the current stream: ``torch.cuda.current_stream().wait_stream(side)`` (what a
  prefetcher does before it hands the batch over) or ``side.synchronize()``.
* No pageable fallback while slots only wait on events: a reader's slot whose event is pending is waited for
  (the oldest copy) rather than handing out a CPU clone, which would make the next ``non_blocking`` copy pageable.
* ``close()`` synchronizes every device with a context before it unregisters a ring, since a batch the caller
  still holds may be copying. A failed register or unregister clears CUDA's error state (it would surface at the
  user's next kernel launch), warns once with the error's name; a ring that failed to register stays pageable
  (copies still correct, slower), one that failed to unregister keeps its mapping for the life of the process (a
  new mapping at that address would fail as already registered).
Rings of readers that died and were respawned stay registered until close (at most ``max_restarts`` per reader).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from gigashuffle.config import DataloaderConfig
from gigashuffle.schema import INDEX_KEY
from gigashuffle.shm.buffer import BatchRing
from gigashuffle.trainer.cudaops import CudaOps, Event
from gigashuffle.trainer.releases import AllOf, ReleaseQueue

log = logging.getLogger(__name__)

Batch = list[dict[str, torch.Tensor]]
# Ranges whose unregister failed: their mappings must outlive this process's use of them (see the NOTE).
_STILL_REGISTERED: list[torch.Tensor] = []


class Placement:
    """Where batches go: ``device=None`` or ``"cpu"`` without pinning hands out the ring's views as they are."""

    tracks = False  # whether ring slots are released through a ReleaseQueue
    moves = False  # whether batches are copied to a device (the caller then never holds ring memory)
    # With ``moves``: seconds of the trainer's thread spent making device copies (guard, enqueue, event), and their
    # count, for loader.metrics(). The DMA itself overlaps the compute already queued and is not waited for here.
    h2d_s = 0.0
    h2d_copies = 0

    @property
    def pending(self) -> int:
        return 0

    def adopt(self, ring: BatchRing) -> None:
        """A reader's ring arrived (``RingReady``)."""

    def deliver(self, ring: BatchRing, k: int, release: Callable[[], None]) -> Batch:
        return ring.batch(k, release)

    def poll(self, wait: bool = False) -> int:
        return 0

    def place(self, batch: Batch) -> Batch:
        """``batch`` (the caller's own memory, e.g. the dummy batch) where delivered batches go."""
        return batch

    def close(self) -> None:
        """Release what is left; safe to call twice."""


class CudaPlacement(Placement):
    """Rings registered with CUDA; with ``moves``, batches copied to GPU ``index`` (NOTE [ GPU placement ])."""

    tracks = True

    def __init__(self, cuda: CudaOps, index: int, moves: bool) -> None:
        self.cuda = cuda
        self.index = index  # the rank's own GPU: every CUDA call below runs under a guard for it
        self.moves = moves
        self.releases = ReleaseQueue(self._pin_only_event)
        # id(ring.memory) -> (ring.memory, the registered range or None if the register failed). Holding the memory
        # keeps its id from being reused by the ring of a respawned reader, which must be registered too.
        self._rings: dict[int, tuple[object, torch.Tensor | None]] = {}
        self._copy_stream: object | None = None
        self._warned: set[str] = set()
        self._closed = False

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
            raise AssertionError("a batch of a ring that never arrived through RingReady")
        ticket = self.releases.ticket(release)
        if not self.moves:
            return ring.batch(k, ticket.dropped)
        base = k * ring.slot_bytes
        started = time.perf_counter()
        with self.cuda.guard(self.index):
            copy_stream = self._stream()
            compute = self.cuda.current_stream(self.index)
            # The slot's fields are one block [0, index_offset): one DMA, then views of it on the device.
            block = self.cuda.copy(ring.memory.view(base, ring.index_offset), self.index, copy_stream)
            event = self.cuda.new_event()
            self.cuda.record(event, copy_stream)
            self.cuda.wait_stream(compute, copy_stream)
            self.cuda.record_stream(block, compute)
        ticket.event = event
        index = ring.memory.view(base + ring.index_offset, ring.bs * 8).view(torch.int64).clone()
        ticket.dropped()  # the caller never holds ring memory: pending now, released once the event completes
        batch = _views(ring, block, index)
        self.h2d_s += time.perf_counter() - started
        self.h2d_copies += 1
        return batch

    def _stream(self) -> object:
        if self._copy_stream is None:
            self._copy_stream = self.cuda.new_stream(self.index)
        return self._copy_stream

    def _pin_only_event(self) -> Event | None:
        events = []
        for i in self._contexts():
            with self.cuda.guard(i):
                event = self.cuda.new_event()
                self.cuda.record(event, self.cuda.current_stream(i))
                events.append(event)
        return AllOf(events) if events else None

    def _contexts(self) -> list[int]:
        return [i for i in range(self.cuda.device_count()) if self.cuda.has_context(i)]

    def poll(self, wait: bool = False) -> int:
        return self.releases.poll(wait)

    def place(self, batch: Batch) -> Batch:
        if not self.moves:
            return batch
        with self.cuda.guard(self.index):
            stream = self.cuda.current_stream(self.index)
            return [
                {key: t if key == INDEX_KEY else self.cuda.copy(t, self.index, stream) for key, t in group.items()}
                for group in batch
            ]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Errors are logged, not raised: this runs in the loader's finalizer too, possibly at interpreter exit when
        # CUDA is already torn down, and the processes must still be stopped after it.
        try:
            for i in self._contexts():  # a batch the caller still holds may be copying out of a ring
                with self.cuda.guard(i):
                    self.cuda.synchronize(i)
            self.releases.drain()
        except Exception as exc:
            log.warning("could not wait for the copies out of the reader rings: %s", exc)
        for _memory, anchor in self._rings.values():
            if anchor is not None:
                self._unregister(anchor)
        self._rings.clear()

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


def _views(ring: BatchRing, block: torch.Tensor, index: torch.Tensor) -> Batch:
    """The batch of one slot's field bytes ``block`` (wherever it is), shaped like the dataset's chunks."""
    bs = ring.bs
    batch: Batch = [{} for _ in range(ring.layout.num_groups)]
    for off, spec in zip(ring.field_offsets, ring.layout.fields, strict=True):
        raw = block[off : off + bs * spec.row_bytes]
        batch[spec.group][spec.key] = raw.view(spec.dtype).view(bs, *spec.shape)
    batch[0][INDEX_KEY] = index
    return batch


def _cuda_missing(field: str, value: object, fix: str) -> ValueError:
    why = (
        "this torch is built without CUDA"
        if torch.version.cuda is None
        else "torch.cuda.is_available() is False (no GPU visible: check CUDA_VISIBLE_DEVICES and the driver)"
    )
    return ValueError(f"DataloaderConfig.{field}={value!r} needs CUDA, but {why} (torch {torch.__version__}); {fix}")


def resolve_device(config: DataloaderConfig, cuda: CudaOps | None = None) -> torch.device | None:
    """The device batches go to (None: they stay in the ring); ValueError if this machine lacks it. ``"cuda"`` is
    the rank's own GPU (NOTE [ GPU placement ]), never the device current when the loader is built."""
    if config.device is None:
        return None
    cuda = cuda or CudaOps()
    device = torch.device(config.device)
    if device.type == "cpu":
        return device
    if not cuda.is_available():
        raise _cuda_missing(
            "device", config.device, "install a CUDA build of torch and run on a GPU machine, or use device='cpu'"
        )
    count = cuda.device_count()
    if device.index is None:
        if count == 1 or config.local_rank < count:
            return torch.device("cuda", 0 if count == 1 else config.local_rank)
        raise ValueError(
            f"DataloaderConfig.device='cuda' is ambiguous: local_rank={config.local_rank} sees {count} GPUs; give "
            "each rank one GPU (CUDA_VISIBLE_DEVICES) or name it: device='cuda:N' with N below that"
        )
    if device.index >= count:
        raise ValueError(
            f"DataloaderConfig.device={config.device!r} is invalid: this process sees {count} GPUs (after "
            "CUDA_VISIBLE_DEVICES); use device='cuda' (the rank's own GPU: cuda:{local_rank}, or cuda:0 when each "
            "rank sees one) or an index below that"
        )
    return device


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
        # The guard's device for registering rings: the rank's own GPU, as for device="cuda".
        return CudaPlacement(cuda, config.local_rank % max(1, cuda.device_count()), moves=False)
    return Placement()
