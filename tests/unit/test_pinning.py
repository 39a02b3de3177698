"""Pinned rings without a GPU: the release-after-the-copy logic, the placements against a fake CUDA that models
devices, streams and copies in flight (tests/fakecuda.py), and the errors a machine without CUDA gives for
``pin_memory`` and a CUDA ``device`` (NOTE [ GPU placement ] in gigashuffle/trainer/pinning.py)."""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from fakecuda import FakeCuda

from gigashuffle import INDEX_KEY, DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import BatchRing
from gigashuffle.trainer import pinning
from gigashuffle.trainer.cudaops import CudaOps, Event
from gigashuffle.trainer.pinning import CudaPlacement, Placement, placement, resolve_device
from gigashuffle.trainer.releases import ReleaseQueue

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


Batch = list[dict[str, torch.Tensor]]
BS = 4


def _config(**fields: object) -> DataloaderConfig:
    if "local_world_size" in fields:
        fields.setdefault("global_world_size", fields["local_world_size"])
    return DataloaderConfig(bs=BS, shuffle_size=64, queue_name="q", **fields)  # type: ignore[arg-type]


def _ring() -> BatchRing:
    """A ring like a reader's: an int64 id and a float row per row, in two fields (two regions of one block)."""
    chunk = [{"id": torch.arange(BS, dtype=torch.int64), "x": torch.zeros(BS, 3)}]
    return BatchRing(Layout.from_chunk(chunk), bs=BS, depth=2)


def _write(ring: BatchRing, k: int, first: int) -> None:
    """What a reader does: rows ``first .. first + BS - 1`` into slot ``k`` (id, x = id in every column)."""
    fields, index = ring.regions(k)
    ids = torch.arange(first, first + BS, dtype=torch.int64)
    fields[0].view(torch.int64).view(BS).copy_(ids)
    fields[1].view(torch.float32).view(BS, 3).copy_(ids.float().unsqueeze(1).expand(BS, 3))
    index.copy_(ids)


def _reader(ring: BatchRing, k: int, log: list[str]) -> Callable[[], None]:
    """The release of slot ``k``: the reader overwrites the slot at once with rows it has not delivered (-100..)."""

    def release() -> None:
        log.append(f"release {k}")
        _write(ring, k, -100)

    return release


def _check_rows(batch: Batch, first: int) -> None:
    ids = torch.arange(first, first + BS, dtype=torch.int64)
    assert torch.equal(batch[0]["id"], ids), f"torn or repeated rows: {batch[0]['id'].tolist()}"
    assert torch.equal(batch[0]["x"], ids.float().unsqueeze(1).expand(BS, 3)), "torn rows in x"


@pytest.fixture
def ring() -> Iterator[BatchRing]:
    ring = _ring()
    yield ring
    ring.close()


def _device_placement(cuda: FakeCuda, local_rank: int = 1) -> CudaPlacement:
    place = placement(_config(device="cuda", local_rank=local_rank, local_world_size=2), cuda)
    assert isinstance(place, CudaPlacement) and place.moves
    return place


def test_device_mode_releases_a_slot_only_after_its_copy_ran(ring: BatchRing) -> None:
    cuda = FakeCuda()
    place = _device_placement(cuda)
    place.adopt(ring)
    log: list[str] = []
    batches = []
    for k in range(2):
        _write(ring, k, 10 * k)
        batches.append(place.deliver(ring, k, _reader(ring, k, log)))
    assert place.pending == 2, "the caller never holds ring memory: both slots wait only on their copies"
    for _ in range(3):
        assert place.poll() == 0, "a copy is queued on the copy stream, nothing ran it"
    assert log == []
    # The compute stream waits on the copy stream: running the step (what the GPU does) runs the copies.
    cuda.current_stream(1).advance()
    assert place.poll() == 2 and sorted(log) == ["release 0", "release 1"]
    cuda.advance_all()
    for k, batch in enumerate(batches):
        _check_rows(batch, 10 * k)
    place.close()


def test_device_mode_makes_one_copy_per_slot_and_keeps_the_index_on_the_cpu(ring: BatchRing) -> None:
    cuda = FakeCuda()
    place = _device_placement(cuda)
    place.adopt(ring)
    _write(ring, 0, 7)
    batch = place.deliver(ring, 0, lambda: None)
    assert cuda.copies == 1, "one DMA of the slot's field block, not one per field"
    assert all(cuda.on_device(batch[0][key]) for key in ("id", "x")), "fields are views of the device block"
    assert not cuda.on_device(batch[0][INDEX_KEY]), "the index stays on the CPU (evict() would sync)"
    assert torch.equal(batch[0][INDEX_KEY], torch.arange(7, 7 + BS)), "the index is read at delivery"
    compute = cuda.current_stream(1)
    assert [stream for _ptr, stream in cuda.consumers] == [compute], "the allocator learns the compute stream"
    assert cuda.host_syncs == 0, "nothing on the hot path waits for the GPU"
    cuda.advance_all()
    _check_rows(batch, 7)
    place.close()


def test_device_cuda_is_the_ranks_own_gpu_whatever_device_is_current() -> None:
    cuda = FakeCuda(devices=4)
    with cuda.guard(0):  # built before set_device: the current device is 0
        assert resolve_device(_config(device="cuda", local_rank=2, local_world_size=4), cuda) == torch.device("cuda", 2)
    # CUDA_VISIBLE_DEVICES gives each rank one GPU: it is cuda:0 in every rank.
    one = FakeCuda(devices=1)
    assert resolve_device(_config(device="cuda", local_rank=3, local_world_size=4), one) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"device='cuda:3'.*sees 1 GPUs.*device='cuda' \(the rank's own GPU"):
        resolve_device(_config(device="cuda:3", local_rank=3, local_world_size=4), one)
    two = FakeCuda(devices=2)
    with pytest.raises(ValueError, match=r"device='cuda' is ambiguous: local_rank=3 sees 2 GPUs"):
        resolve_device(_config(device="cuda", local_rank=3, local_world_size=4), two)


@pytest.mark.parametrize("moves", [True, False], ids=["device", "pin_memory only"])
def test_every_cuda_call_runs_on_the_ranks_gpu(ring: BatchRing, moves: bool) -> None:
    cuda = FakeCuda()
    fields = {"device": "cuda"} if moves else {"pin_memory": True}
    place = placement(_config(local_rank=1, local_world_size=2, **fields), cuda)
    place.adopt(ring)  # cudaHostRegister makes a context on the current device: 0 without the guard
    _write(ring, 0, 0)
    batch = place.deliver(ring, 0, lambda: None)
    if not moves:
        with cuda.guard(1):  # the user copies to its GPU
            cuda.copy(batch[0]["id"], 1, cuda.current_stream(1))
    del batch
    place.poll()
    place.close()
    assert set(cuda.contexts) == {1}, f"contexts on {sorted(cuda.contexts)}: a CUDA call ran without a device guard"


def _pin_only(cuda: FakeCuda, local_rank: int = 1) -> CudaPlacement:
    place = placement(_config(pin_memory=True, local_rank=local_rank, local_world_size=2), cuda)
    assert isinstance(place, CudaPlacement) and not place.moves
    return place


def test_pin_only_covers_a_copy_to_a_gpu_that_is_not_the_current_device(ring: BatchRing) -> None:
    cuda = FakeCuda()
    place = _pin_only(cuda, local_rank=0)
    place.adopt(ring)  # the rank's GPU is 0 and so is the current device...
    log: list[str] = []
    _write(ring, 0, 20)
    batch = place.deliver(ring, 0, _reader(ring, 0, log))
    assert batch[0]["id"].data_ptr() in range(min(cuda.registered), min(cuda.registered) + ring.nbytes)
    # ...but the user, who never called set_device, copies to cuda:1 on that device's current stream.
    on_gpu = {key: cuda.copy(t, 1, cuda.current_stream(1)) for key, t in batch[0].items()}
    del batch
    assert place.poll() == 0 and place.pending == 1, "the copy to cuda:1 has not run"
    cuda.current_stream(0).advance()
    assert place.poll() == 0, "an event on cuda:0's stream does not cover a copy on cuda:1"
    cuda.current_stream(1).advance()
    assert place.poll() == 1 and log == ["release 0"]
    _check_rows([on_gpu], 20)
    place.close()


def test_pin_only_covers_a_side_stream_copy_the_current_stream_waited_for(ring: BatchRing) -> None:
    cuda = FakeCuda()
    place = _pin_only(cuda)
    place.adopt(ring)
    log: list[str] = []
    _write(ring, 0, 30)
    batch = place.deliver(ring, 0, _reader(ring, 0, log))
    with cuda.guard(1):  # a prefetcher: copies on its side stream, the compute stream waits on it
        side = cuda.new_stream(1)
        on_gpu = {key: cuda.copy(t, 1, side) for key, t in batch[0].items()}
        cuda.wait_stream(cuda.current_stream(1), side)
    del batch
    assert place.poll() == 0
    cuda.current_stream(1).advance()  # the compute stream passes its wait: the side stream's copies ran
    assert place.poll() == 1
    _check_rows([on_gpu], 30)
    place.close()


def test_pin_only_covers_a_copy_made_in_another_thread(ring: BatchRing) -> None:
    cuda = FakeCuda()
    place = _pin_only(cuda, local_rank=0)
    place.adopt(ring)
    log: list[str] = []
    _write(ring, 0, 60)
    batch = place.deliver(ring, 0, _reader(ring, 0, log))
    on_gpu: list[dict[str, torch.Tensor]] = []

    def copier(group: dict[str, torch.Tensor]) -> None:  # the user's thread: its current device is 0
        on_gpu.append({key: cuda.copy(t, 1, cuda.current_stream(1)) for key, t in group.items()})

    thread = threading.Thread(target=copier, args=(batch[0],))
    thread.start()
    thread.join(timeout=60)
    assert on_gpu, "the copying thread did not finish"
    del batch
    assert place.poll() == 0, "the copy made in the other thread has not run"
    cuda.current_stream(1).advance()
    assert place.poll() == 1
    _check_rows([on_gpu[0]], 60)
    place.close()


def test_pin_only_with_no_context_yet_releases_at_once(ring: BatchRing) -> None:
    cuda = FakeCuda()
    place = _pin_only(cuda)
    place.adopt(ring)
    cuda.contexts.clear()  # as if the registration had made none: no copy can have been enqueued
    batch = place.deliver(ring, 0, lambda: None)
    del batch
    assert place.poll() == 1


def test_close_waits_for_copies_of_batches_the_caller_still_holds(ring: BatchRing) -> None:
    cuda = FakeCuda()
    place = _pin_only(cuda)
    place.adopt(ring)
    _write(ring, 0, 40)
    batch = place.deliver(ring, 0, lambda: None)
    on_gpu = {key: cuda.copy(t, 1, cuda.current_stream(1)) for key, t in batch[0].items()}
    place.close()  # the caller still holds the batch, its copy is queued
    assert cuda.unregistered_in_flight == 0, "a ring was unregistered under a copy in flight"
    assert cuda.registered == {}
    _check_rows([on_gpu], 40)
    del batch


def test_a_failed_register_clears_the_error_warns_once_and_the_ring_stays_usable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cuda = FakeCuda()
    place = _device_placement(cuda)
    cuda.fail_register = 2
    rings = [_ring(), _ring()]
    with caplog.at_level(logging.WARNING, logger=pinning.__name__):
        for ring in rings:
            place.adopt(ring)
    warnings = [r.getMessage() for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    assert len(warnings) == 1 and "cudaErrorMemoryAllocation" in warnings[0] and "cuda:1" in warnings[0]
    cuda.launch_kernel()  # the user's next kernel does not raise the register's error as its own
    _write(rings[0], 0, 50)
    batch = place.deliver(rings[0], 0, lambda: None)  # pageable: staged by CUDA, still correct
    cuda.advance_all()
    _check_rows(batch, 50)
    place.close()
    assert cuda.registered == {}
    for ring in rings:
        ring.close()


def test_a_failed_unregister_keeps_the_mapping(ring: BatchRing, caplog: pytest.LogCaptureFixture) -> None:
    cuda = FakeCuda()
    place = _device_placement(cuda)
    place.adopt(ring)
    cuda.fail_unregister = 1
    kept = len(pinning._STILL_REGISTERED)
    with caplog.at_level(logging.WARNING, logger=pinning.__name__):
        place.close()
    assert any("cudaErrorInvalidValue" in r.getMessage() for r in caplog.records)
    assert len(pinning._STILL_REGISTERED) == kept + 1, "the registered range must stay mapped"
    assert pinning._STILL_REGISTERED[-1].data_ptr() in cuda.registered
    cuda.launch_kernel()
    pinning._STILL_REGISTERED.pop()


def test_a_ring_is_registered_when_it_arrives_once_and_each_respawned_ring_too() -> None:
    cuda = FakeCuda()
    place = _device_placement(cuda)
    old = _ring()
    with pytest.raises(AssertionError, match="never arrived through RingReady"):
        place.deliver(old, 0, lambda: None)
    place.adopt(old)
    place.adopt(old)
    assert len(cuda.registered) == 1, "a ring is registered once"
    place.deliver(old, 0, lambda: None)
    old.close()
    del old  # the reader died: its ring object goes; the placement still holds the memory until close
    new = _ring()
    place.adopt(new)
    assert len(cuda.registered) == 2, "each ring is registered"
    cuda.advance_all()
    place.close()
    assert cuda.registered == {}
    new.close()


# -- issue 33: every exception path returns the slot; close waits on the loader's own events only ----------------
def test_device_mode_a_copy_that_raises_returns_its_slot_every_time(ring: BatchRing) -> None:
    cuda = FakeCuda()
    place = _device_placement(cuda)
    place.adopt(ring)
    log: list[str] = []
    cuda.fail_copies = 5  # more than the ring's depth: a catch-and-retry loop must not run out of slots
    for n in range(5):
        with pytest.raises(RuntimeError, match="out of memory"):
            place.deliver(ring, n % 2, _reader(ring, n % 2, log))
        # Nothing was queued that reads the slot: it goes back at the next poll, without waiting for the GPU.
        assert place.poll() == 1 and log[-1] == f"release {n % 2}", log
    assert place.pending == 0 and cuda.host_syncs == 0
    _write(ring, 0, 70)
    batch = place.deliver(ring, 0, _reader(ring, 0, log))  # the copies work again
    cuda.advance_all()
    _check_rows(batch, 70)
    place.close()


class _InterruptedAfterTheCopy(FakeCuda):
    """A hand-over cut after its copy was queued (an interrupt, or any error in the bookkeeping after the DMA)."""

    def record_stream(self, tensor: torch.Tensor, stream: object) -> None:
        raise KeyboardInterrupt


def test_device_mode_a_hand_over_cut_after_the_copy_returns_the_slot_only_after_the_copy(ring: BatchRing) -> None:
    cuda = _InterruptedAfterTheCopy()
    place = _device_placement(cuda)
    place.adopt(ring)
    log: list[str] = []
    _write(ring, 0, 80)
    with pytest.raises(KeyboardInterrupt):
        place.deliver(ring, 0, _reader(ring, 0, log))
    assert cuda.copies == 1 and place.pending == 1
    assert place.poll() == 0 and log == [], "the slot was returned while its copy was still queued"
    cuda.copy_streams[1].advance()
    assert place.poll() == 1 and log == ["release 0"]
    place.close()
    assert cuda.unregistered_in_flight == 0


def test_device_mode_copies_on_the_loaders_own_high_priority_stream(ring: BatchRing) -> None:
    cuda = FakeCuda()
    place = _device_placement(cuda)
    place.adopt(ring)
    place.deliver(ring, 0, lambda: None)
    copy = cuda.copy_streams.get(1)
    assert copy is not None and copy.priority < 0, "the copy stream is the loader's own, at high priority"
    assert [op for op in copy.ops], "the copy was queued on it"
    place.deliver(ring, 1, lambda: None)
    assert len(cuda.copy_streams) == 1 and copy.enqueued == 2, "one copy stream per device, made once"
    cuda.advance_all()
    place.close()


def test_device_mode_the_consumer_is_the_current_stream_at_next(ring: BatchRing) -> None:
    cuda = FakeCuda()
    place = _device_placement(cuda)
    place.adopt(ring)
    _write(ring, 0, 90)
    with cuda.guard(1):
        compute = cuda.new_stream(1)  # the caller's own compute stream, current while it calls next()
        with cuda.use_stream(compute):
            batch = place.deliver(ring, 0, lambda: None)
    assert [stream for _ptr, stream in cuda.consumers] == [compute], "the allocator learns the stream in use"
    cuda.streams[1].advance()  # the device's default stream does not wait for the copy...
    assert cuda.copy_streams[1].done == 0
    compute.advance()  # ...the stream current at next() does: its next kernel reads the copied rows
    _check_rows(batch, 90)
    place.close()


def test_device_mode_close_never_synchronizes_the_device(ring: BatchRing) -> None:
    cuda = FakeCuda()
    place = _device_placement(cuda)
    place.adopt(ring)
    for k in range(2):
        place.deliver(ring, k, lambda: None)
    cuda.streams[1].stuck = True  # the compute stream waits for a collective that never completes
    place.close()  # would fail the test (a hang on a GPU) if it synchronized the device
    assert cuda.device_syncs == 0 and cuda.timed_out_waits == 0
    assert cuda.registered == {} and cuda.unregistered_in_flight == 0, "it waited for its own copies"


def test_pin_only_close_gives_up_at_its_deadline_and_keeps_the_rings_registered(
    ring: BatchRing, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cuda = FakeCuda()
    place = _pin_only(cuda)
    place.adopt(ring)
    batch = place.deliver(ring, 0, lambda: None)  # still held: the caller's copy may run after close
    cuda.copy(batch[0]["id"], 1, cuda.current_stream(1))
    cuda.streams[1].stuck = True
    monkeypatch.setattr(pinning, "CLOSE_WAIT_S", 0.2)
    kept = len(pinning._STILL_REGISTERED)
    with caplog.at_level(logging.WARNING, logger=pinning.__name__):
        place.close()
    assert cuda.device_syncs == 0 and cuda.timed_out_waits > 0
    assert any("did not complete within" in r.getMessage() for r in caplog.records)
    assert len(cuda.registered) == 1, "a ring a copy may still read stays registered (and mapped)"
    assert len(pinning._STILL_REGISTERED) == kept + 1
    del pinning._STILL_REGISTERED[kept:]
    del batch


def test_pin_only_release_after_covers_a_side_stream_copy_never_ordered_onto_the_current_stream(
    ring: BatchRing,
) -> None:
    cuda = FakeCuda()
    place = _pin_only(cuda)
    place.adopt(ring)
    log: list[str] = []
    with cuda.guard(1):
        side = cuda.new_stream(1)
    place.release_after(side)
    place.release_after(side)  # said twice: one event per drop still
    _write(ring, 0, 100)
    batch = place.deliver(ring, 0, _reader(ring, 0, log))
    on_gpu = {key: cuda.copy(t, 1, side) for key, t in batch[0].items()}  # a prefetcher's copy
    del batch  # before the current stream waits on the side stream (it may never)
    assert place.poll() == 0 and log == [], "the slot was released under the side stream's copy"
    side.advance()
    assert place.poll() == 1 and log == ["release 0"]
    _check_rows([on_gpu], 100)
    place.close()


def test_pin_only_a_copy_handed_out_to_a_caller_holding_the_ring_is_pinned(ring: BatchRing) -> None:
    cuda = FakeCuda()
    place = _pin_only(cuda)
    place.adopt(ring)
    _write(ring, 0, 110)
    copy = place.clone(ring.batch(0))
    assert all(cuda.is_pinned(t) for t in copy[0].values()), "a pageable copy: the next non_blocking copy syncs"
    assert not any(t.data_ptr() in range(min(cuda.registered), min(cuda.registered) + ring.nbytes)
                   for t in copy[0].values()), "a copy of its own, not a view of the ring"  # fmt: skip
    _check_rows(copy, 110)
    assert set(cuda.contexts) == {1}
    place.close()


def test_pin_only_registers_on_the_current_device_where_local_rank_names_no_gpu(ring: BatchRing) -> None:
    cuda = FakeCuda(devices=2)
    # local_rank 3 with 2 GPUs visible (e.g. CUDA_VISIBLE_DEVICES gave each rank two): the rank's GPU is the one it
    # made current, not 3 % 2.
    place = placement(_config(pin_memory=True, local_rank=3, local_world_size=4), cuda)
    with cuda.guard(0):
        place.adopt(ring)
    place.close()
    assert set(cuda.contexts) == {0}, f"contexts on {sorted(cuda.contexts)}: not the rank's current device"
    for rank, own in ((0, 0), (1, 1)):
        assert isinstance(p := placement(_config(pin_memory=True, local_rank=rank, local_world_size=2), cuda),
                          CudaPlacement) and p.index == own  # fmt: skip
    one = FakeCuda(devices=1)
    assert isinstance(p := placement(_config(pin_memory=True, local_rank=3, local_world_size=4), one),
                      CudaPlacement) and p.index == 0  # fmt: skip


_RUNTIME_C = "int calls = 0; int cudaGetLastError(void) { calls++; return 0; }"


def _cc(source: str, out: Path, *flags: str) -> None:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(src), *flags], check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("cc") is None, reason="builds two stand-in CUDA runtimes with a C compiler")
def test_clear_error_calls_the_runtime_torch_uses_not_another_one_in_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's runtime, reached only as a dependency of torch's CUDA library; a second runtime (CuPy's, JAX's) is
    # loaded too, and sorts first among the process's libcudart mappings.
    (tmp_path / "torch" / "lib").mkdir(parents=True)
    (tmp_path / "runtime").mkdir()
    (tmp_path / "a_decoy").mkdir()
    ours, decoy = tmp_path / "runtime" / "libcudart.so.12", tmp_path / "a_decoy" / "libcudart.so.12"
    _cc(_RUNTIME_C, ours, "-Wl,-soname,libcudart.so.12")
    _cc(_RUNTIME_C, decoy, "-Wl,-soname,libcudart.so.11.0")
    torch_cuda = tmp_path / "torch" / "lib" / "libtorch_cuda.so"
    _cc("int torch_cuda_marker(void) { return 1; }", torch_cuda, "-Wl,--no-as-needed", f"-L{ours.parent}",
        "-l:libcudart.so.12", f"-Wl,-rpath,{ours.parent}")  # fmt: skip
    loaded = [ctypes.CDLL(str(torch_cuda)), ctypes.CDLL(str(decoy))]
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "torch" / "__init__.py"))
    CudaOps().clear_error(0)
    ours_calls = ctypes.c_int.in_dll(ctypes.CDLL(str(ours)), "calls").value
    decoy_calls = ctypes.c_int.in_dll(loaded[1], "calls").value
    assert (ours_calls, decoy_calls) == (1, 0), "cudaGetLastError ran in a runtime torch does not use"


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
