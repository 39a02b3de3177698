"""Pin-only mode's events (NOTE [ GPU placement ] in trainer/pinning.py): the caller copies out of the rings itself,
on streams the loader cannot see, so a dropped batch's slot waits on an event recorded on each stream that may run
such a copy."""

from __future__ import annotations

from gigashuffle.trainer.cudaops import CudaOps, Event
from gigashuffle.trainer.placement import Placement
from gigashuffle.trainer.releases import AllOf


class PinOnlyEvents(Placement):
    """The part of ``CudaPlacement`` that records those events: its base, not a placement of its own."""

    cuda: CudaOps
    _side_streams: list[object]

    def release_after(self, stream: object) -> None:
        """Pin-only: the caller copies out of batches on ``stream`` too (a prefetcher's side stream). The event each
        dropped batch's slot waits on is then also recorded on it, after the drop, so a copy enqueued there before
        the drop is covered without ordering it onto the current stream. For the loader's life; device mode needs
        none (the caller never holds ring memory)."""
        if self.moves or any(stream is s for s in self._side_streams):
            return
        self._side_streams.append(stream)

    def _pin_only_event(self) -> Event | None:
        events = []
        for i in self._contexts():
            with self.cuda.guard(i):
                event = self.cuda.new_event()
                self.cuda.record(event, self.cuda.current_stream(i))
                events.append(event)
        for stream in self._side_streams:
            with self.cuda.guard(self.cuda.stream_device(stream)):
                event = self.cuda.new_event()
                self.cuda.record(event, stream)
                events.append(event)
        return AllOf(events) if events else None

    def _contexts(self) -> list[int]:
        return [i for i in range(self.cuda.device_count()) if self.cuda.has_context(i)]
