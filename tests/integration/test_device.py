"""``device`` and ``pin_memory`` with real processes and Redis, on a machine without a GPU: ``device="cpu"``, and the
loader's event-gated ring releases driven by a fake GPU placement (NOTE [ Pinned rings ] in gigashuffle/pinning.py).
What needs CUDA itself (cudaHostRegister, real events, non_blocking copies) is not exercised here."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import torch
from datasets import UniqueIds, check_unique_batch, take

from gigashuffle import INDEX_KEY, DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.shm.buffer import BatchRing
from gigashuffle.trainer import pinning
from gigashuffle.trainer.pinning import Event, Ticket, TrackedPlacement

Batch = list[dict[str, torch.Tensor]]


def _config(redis_url: str, **fields: object) -> DataloaderConfig:
    return DataloaderConfig(
        bs=4, shuffle_size=64, queue_name=f"device-{uuid.uuid4().hex[:8]}", num_writers=1, num_readers=1,
        ring_depth=2, redis_url=redis_url, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def test_device_cpu_yields_the_usual_batches(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, device="cpu")) as loader:
        seen: set[int] = set()
        for batch in take(iter(loader), 20):
            ids = check_unique_batch(batch, 4, 64)
            assert all(t.device.type == "cpu" for t in batch[0].values())
            assert not seen.intersection(ids), "a row was delivered twice"
            seen.update(ids)


class _Event:
    """Done after ``queries`` queries (never by querying if None) or when waited for."""

    def __init__(self, queries: int | None, syncs: list[int]) -> None:
        self.left = queries
        self.syncs = syncs
        self.done = False

    def query(self) -> bool:
        if self.left is not None:
            self.left -= 1
            self.done = self.done or self.left <= 0
        return self.done

    def synchronize(self) -> None:
        self.syncs.append(1)
        self.done = True


class _FakeGpu(TrackedPlacement):
    """Pins nothing, "moves" by cloning, and releases ring slots only after fake events: the loader's own glue."""

    def __init__(self, moves: bool, queries: int | None) -> None:
        super().__init__(torch.device("cpu") if moves else None)
        self.queries = queries
        self.events: list[_Event] = []
        self.syncs: list[int] = []
        self.pinned = 0
        self.unpinned = 0
        self.released = 0
        self.tickets = 0  # batches delivered through the placement (not as copies)
        self.early = 0  # slots released while their event was not done: must stay 0
        self._make_ticket = self.releases.ticket
        self.releases.ticket = self.ticket  # type: ignore[method-assign]  # every ticket's release is checked

    def pin(self, ring: BatchRing) -> Callable[[], None]:
        self.pinned += 1

        def unpin() -> None:
            self.unpinned += 1

        return unpin

    def move(self, views: Batch) -> Batch:
        return [{key: t.clone() for key, t in group.items()} for group in views]

    def new_event(self) -> Event:
        event = _Event(self.queries, self.syncs)
        self.events.append(event)
        return event

    def ticket(self, release: Callable[[], None]) -> Ticket:
        def checked() -> None:
            if not (isinstance(ticket.event, _Event) and ticket.event.done):
                self.early += 1
            self.released += 1
            release()

        self.tickets += 1
        ticket = self._make_ticket(checked)
        return ticket


@pytest.mark.parametrize(
    ("moves", "queries"),
    [(True, None), (False, 2)],
    ids=["device: copies finish only when waited for", "pin_memory only: copies finish after 2 queries"],
)
def test_ring_slots_go_back_only_after_the_copy_and_iteration_never_stalls(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, moves: bool, queries: int | None
) -> None:
    fake = _FakeGpu(moves, queries)
    monkeypatch.setattr(pinning, "placement", lambda config: fake)
    n = 40  # 20 times the ring's depth: every slot is reused many times
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url)) as loader:
        seen: set[int] = set()
        it = iter(loader)
        for _ in range(n):
            batch = take(it, 1)[0]  # dropped before the next one: its ring slot may be released
            ids = check_unique_batch(batch, 4, 64)
            assert not seen.intersection(ids), "a row was delivered twice"
            seen.update(ids)
            if moves:
                assert batch[0][INDEX_KEY].untyped_storage().nbytes() == 4 * 8, "a device batch is not ring memory"
        assert fake.pinned == 1, "the one reader's ring is registered once"
        assert fake.early == 0
        assert fake.released >= 1, "slots come back to the reader"
        if moves:
            assert fake.tickets == n, "device batches are never copies made on the CPU first"
            assert fake.syncs, "with every slot waiting on a copy, the loader waited for the oldest"
        del batch
    assert fake.pending == 0 and fake.unpinned == 1, "close waits for every copy, then unregisters the ring"
    assert fake.early == 0
    assert fake.released == fake.tickets


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (not run on CPU machines)")


@needs_cuda
def test_on_a_gpu_batches_arrive_on_the_device_from_pinned_rings(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, device="cuda:0")) as loader:
        dummy = loader.get_dummy_batch()
        assert all(t.device == torch.device("cuda", 0) for t in dummy[0].values())
        seen: set[int] = set()
        it = iter(loader)
        for _ in range(40):  # 20 times the ring's depth: every slot is reused while copies may be in flight
            batch = take(it, 1)[0]
            assert all(t.device == torch.device("cuda", 0) for t in batch[0].values())
            ids = check_unique_batch([{k: t.cpu() for k, t in batch[0].items()}], 4, 64)
            assert not seen.intersection(ids), "a row was delivered twice"
            seen.update(ids)


@needs_cuda
def test_on_a_gpu_pin_memory_hands_out_pinned_views(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, pin_memory=True)) as loader:
        it = iter(loader)
        for _ in range(20):
            batch = take(it, 1)[0]
            assert batch[0]["x"].is_pinned(), "a batch is a view of a ring registered with CUDA"
            on_gpu = {k: t.to("cuda", non_blocking=True) for k, t in batch[0].items()}
            del batch  # the slot goes back only after the copies above finished
            check_unique_batch([{k: t.cpu() for k, t in on_gpu.items()}], 4, 64)
