"""Pinned rings without a GPU: the release-after-the-copy logic with fake events, and the errors a machine without
CUDA gives for ``pin_memory`` and a CUDA ``device`` (NOTE [ Pinned rings ] in gigashuffle/pinning.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gigashuffle import INDEX_KEY, DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import BatchRing
from gigashuffle.trainer.pinning import Event, Placement, ReleaseQueue, TrackedPlacement, placement, resolve_device

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")


class FakeEvent:
    """An event whose copies finish after ``queries`` calls of ``query()``, or at ``synchronize()``."""

    def __init__(self, log: list[str], name: str, queries: int) -> None:
        self.log = log
        self.name = name
        self.left = queries
        self.done = queries == 0

    def query(self) -> bool:
        if not self.done:
            self.left -= 1
            self.done = self.left <= 0
        return self.done

    def synchronize(self) -> None:
        self.log.append(f"sync {self.name}")
        self.done = True


class Events:
    """Makes ``FakeEvent``s named e0, e1, ...; each finishes after ``queries`` queries (None: only by waiting)."""

    def __init__(self, queries: int | None) -> None:
        self.queries = queries
        self.made: list[FakeEvent] = []
        self.log: list[str] = []

    def __call__(self) -> Event:
        event = FakeEvent(self.log, f"e{len(self.made)}", 10**9 if self.queries is None else self.queries)
        self.made.append(event)
        self.log.append(f"record {event.name}")
        return event


def releaser(log: list[str], name: str, events: list[FakeEvent] | None = None) -> Callable[[], None]:
    def release() -> None:
        if events is not None:
            assert all(e.done for e in events), f"{name} released before its copy finished"
        log.append(f"release {name}")

    return release


def test_a_slot_is_released_only_after_its_event_completes() -> None:
    events = Events(queries=3)
    queue = ReleaseQueue(events)
    ticket = queue.ticket(releaser(events.log, "t0", events.made))
    ticket.event = events()
    assert queue.poll() == 0, "nothing is released while the batch's views live"
    ticket.dropped()
    assert queue.pending == 1
    assert queue.poll() == 0 and queue.poll() == 0  # two queries: the copy still runs
    assert queue.poll() == 1
    assert queue.pending == 0
    assert events.log == ["record e0", "release t0"]
    assert queue.poll() == 0, "a slot is released once"


def test_pin_only_records_the_event_after_the_caller_dropped_the_batch() -> None:
    events = Events(queries=1)
    queue = ReleaseQueue(events)
    ticket = queue.ticket(releaser(events.log, "t0", events.made))
    events.log.append("caller copies and drops the batch")
    ticket.dropped()
    assert queue.poll() == 1
    # The event comes after the drop, so it follows every copy the caller enqueued before dropping.
    assert events.log == ["caller copies and drops the batch", "record e0", "release t0"]


def test_wait_blocks_on_the_oldest_copy_only_when_nothing_is_done() -> None:
    events = Events(queries=None)
    queue = ReleaseQueue(events)
    tickets = [queue.ticket(releaser(events.log, f"t{i}")) for i in range(3)]
    for ticket in tickets:
        ticket.event = events()
        ticket.dropped()
    assert queue.poll() == 0
    assert queue.poll(wait=True) == 1
    assert events.log[-2:] == ["sync e0", "release t0"]
    events.made[2].done = True  # a later copy finished on its own: no need to wait
    assert queue.poll(wait=True) == 1
    assert events.log[-1] == "release t2" and "sync e1" not in events.log
    queue.drain()
    assert events.log[-2:] == ["sync e1", "release t1"]
    assert queue.pending == 0


def test_drain_waits_for_every_copy_even_of_batches_dropped_just_now() -> None:
    events = Events(queries=None)
    queue = ReleaseQueue(events)
    moved = queue.ticket(releaser(events.log, "moved"))
    moved.event = events()
    moved.dropped()
    pinned = queue.ticket(releaser(events.log, "pinned"))
    pinned.dropped()
    queue.drain()
    assert events.log == ["record e0", "record e1", "sync e0", "release moved", "sync e1", "release pinned"]


class FakeGpu(TrackedPlacement):
    """A TrackedPlacement whose "device" is a CPU clone and whose events are fakes: the placement's own logic."""

    def __init__(self, moves: bool, events: Events) -> None:
        self.events = events
        super().__init__(torch.device("cpu") if moves else None)
        self.pinned: list[int] = []
        self.unpinned: list[object] = []

    def pin(self, ring: BatchRing) -> Callable[[], None]:
        self.pinned.append(ring.nbytes)
        return lambda: self.unpinned.append(ring.nbytes)

    def move(self, views: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        return [{key: t.clone() for key, t in group.items()} for group in views]

    def new_event(self) -> Event:
        return self.events()


def _ring() -> BatchRing:
    chunk = [{"id": torch.arange(4, dtype=torch.int64)}]
    return BatchRing(Layout.from_chunk(chunk), bs=4, depth=2)


@pytest.mark.parametrize("moves", [True, False], ids=["device", "pin_memory only"])
def test_a_placement_pins_each_ring_once_and_releases_after_the_copy(moves: bool) -> None:
    events = Events(queries=2)
    gpu = FakeGpu(moves, events)
    ring = _ring()
    released: list[int] = []
    ring.regions(0)[1].copy_(torch.arange(4))
    batch = gpu.deliver(ring, 0, lambda: released.append(0))
    assert torch.equal(batch[0][INDEX_KEY], torch.arange(4))
    second = gpu.deliver(ring, 1, lambda: released.append(1))
    assert gpu.pinned == [ring.nbytes], "a ring is registered once"
    if moves:
        # The views died inside deliver(): both tickets are pending, each behind the event recorded after its copy.
        assert gpu.pending == 2 and len(events.made) == 2
    else:
        assert gpu.pending == 0 and not events.made, "the caller still holds both batches"
        del batch, second
        assert gpu.pending == 2
    assert gpu.poll() == 0 and released == []
    assert gpu.poll() == 2 and sorted(released) == [0, 1]
    gpu.close()
    gpu.close()
    assert gpu.unpinned == [ring.nbytes]
    ring.close()


def test_close_waits_for_pending_copies_before_unpinning() -> None:
    events = Events(queries=None)
    gpu = FakeGpu(True, events)
    ring = _ring()
    order: list[object] = []
    gpu.deliver(ring, 0, lambda: order.append("released"))
    gpu.unpinned = order  # unpin appends the ring size to the same log
    gpu.close()
    assert events.log[-1] == "sync e0"
    assert order == ["released", ring.nbytes]
    ring.close()


def test_no_pinning_no_device_hands_out_the_rings_views() -> None:
    cfg = DataloaderConfig(bs=4, shuffle_size=8, queue_name="q")
    place = placement(cfg)
    assert type(place) is Placement and not place.tracks and not place.moves
    assert resolve_device(cfg) is None
    assert type(placement(DataloaderConfig(bs=4, shuffle_size=8, queue_name="q", device="cpu"))) is Placement
    assert resolve_device(DataloaderConfig(bs=4, shuffle_size=8, queue_name="q", device="cpu")) == torch.device("cpu")


@no_cuda
@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"pin_memory": True}, r"DataloaderConfig\.pin_memory=True needs CUDA.*set pin_memory=False"),
        ({"device": "cuda"}, r"DataloaderConfig\.device='cuda' needs CUDA.*use device='cpu'"),
        ({"device": torch.device("cuda", 1)}, r"DataloaderConfig\.device=device\(type='cuda', index=1\) needs CUDA"),
        ({"device": "cpu", "pin_memory": True}, r"DataloaderConfig\.pin_memory=True needs CUDA"),
    ],
)
def test_without_cuda_pinning_or_a_cuda_device_is_refused_before_anything_starts(
    fields: dict[str, object], named: str
) -> None:
    cfg = DataloaderConfig(bs=4, shuffle_size=8, queue_name="q", **fields)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=named):
        placement(cfg)
    # The loader checks first: no Redis is needed (none is given here) and no process is started.
    with pytest.raises(ValueError, match=named):
        MultiprocessShuffledDataloader([], cfg)


def test_the_ring_of_a_respawned_reader_is_pinned_too() -> None:
    events = Events(queries=0)
    gpu = FakeGpu(True, events)
    old = _ring()
    gpu.deliver(old, 0, lambda: None)
    old.close()
    del old  # the reader died: its ring object goes; the placement still holds the memory until close
    new = _ring()
    gpu.deliver(new, 0, lambda: None)
    assert gpu.pinned == [new.nbytes, new.nbytes], "each ring is registered"
    gpu.close()
    assert len(gpu.unpinned) == 2
    new.close()
