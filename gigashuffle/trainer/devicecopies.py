"""Device mode's copies (NOTE [ GPU placement ] in trainer/pinning.py): one DMA of a slot's field bytes on the
loader's own copy stream, an event after it, and device-side views of the copied block."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from gigashuffle.schema import INDEX_KEY
from gigashuffle.shm.ring import BatchRing
from gigashuffle.trainer.cudaops import CudaOps, Event
from gigashuffle.trainer.placement import Batch, Placement
from gigashuffle.trainer.releases import Ticket

log = logging.getLogger(__name__)


class _Done:
    """The event of a ticket behind which no copy was enqueued (a copy that raised): released at the next poll."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class DeviceCopies(Placement):
    """The part of ``CudaPlacement`` that makes device copies: its base, not a placement of its own."""

    cuda: CudaOps
    _copy_stream: object | None
    _copied: Event | None

    if TYPE_CHECKING:

        @property
        def index(self) -> int: ...

    def _copy(self, ring: BatchRing, k: int, ticket: Ticket) -> Batch:
        """The device copy of slot ``k``; ``ticket`` gets the event recorded after it."""
        base = k * ring.slot_bytes
        with self.cuda.guard(self.index):
            copy_stream = self._stream()
            # The consumer: the current stream of the device in the thread that called next() (NOTE [ GPU
            # placement ]); it waits on the copy, and the allocator learns that it uses the block.
            consumer = self.cuda.current_stream(self.index)
            # The slot's fields are one block [0, index_offset): one DMA, then views of it on the device.
            block = self.cuda.copy(ring.memory.view(base, ring.index_offset), self.index, copy_stream)
            event = self.cuda.new_event()
            self.cuda.record(event, copy_stream)
            ticket.event = self._copied = event
            self.cuda.wait_stream(consumer, copy_stream)
            self.cuda.record_stream(block, consumer)
        index = ring.memory.view(base + ring.index_offset, ring.bs * 8).view(torch.int64).clone()
        return _views(ring, block, index)

    def _fence(self) -> Event:
        """An event after everything queued on the copy stream so far (a copy of a failed hand-over may be in it)."""
        if self._copy_stream is None:
            return _Done()  # no copy was ever queued
        try:
            with self.cuda.guard(self.index):
                event = self.cuda.new_event()
                self.cuda.record(event, self._copy_stream)
            self._copied = event
            return event
        except Exception as exc:  # CUDA is failing: nothing more runs on the stream, a copy queued in it included
            log.warning("could not record an event on the copy stream after a failed copy: %s", exc)
            return _Done()

    def _stream(self) -> object:
        if self._copy_stream is None:
            self._copy_stream = self.cuda.copy_stream(self.index)
        return self._copy_stream

    def place(self, batch: Batch) -> Batch:
        if not self.moves:
            return batch
        with self.cuda.guard(self.index):
            stream = self.cuda.current_stream(self.index)
            return [
                {key: t if key == INDEX_KEY else self.cuda.copy(t, self.index, stream) for key, t in group.items()}
                for group in batch
            ]


def _views(ring: BatchRing, block: torch.Tensor, index: torch.Tensor) -> Batch:
    """The batch of one slot's field bytes ``block`` (wherever it is), shaped like the dataset's chunks."""
    bs = ring.bs
    batch: Batch = [{} for _ in range(ring.layout.num_groups)]
    for off, spec in zip(ring.field_offsets, ring.layout.fields, strict=True):
        raw = block[off : off + bs * spec.row_bytes]
        batch[spec.group][spec.key] = raw.view(spec.dtype).view(bs, *spec.shape)
    batch[0][INDEX_KEY] = index
    return batch
