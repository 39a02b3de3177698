"""Shared memory, the node buffer and the reader rings: bytes-exact copies and the lifetime of batch views."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import leaks
import numpy as np
import pytest
import torch
from forked import fork_child, wait_child

from gigashuffle import INDEX_KEY
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import RING_BUDGET_BYTES, BatchRing, SharedMemory, SlotBuffer, reclaim, ring_depth_for

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    count = int(np.prod(shape)) * dtype.itemsize
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def make_chunk(rows: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    chunk = [
        {
            "tokens": random_tensor(torch.int64, (rows, 5), seed),
            "mask": random_tensor(torch.bool, (rows, 3), seed + 1),
            "emb": random_tensor(torch.bfloat16, (rows, 2, 3), seed + 2),
        },
        {
            "label": random_tensor(torch.int16, (rows,), seed + 3),
            "score": random_tensor(torch.float64, (rows, 1), seed + 4),
            "tiny": random_tensor(torch.uint8, (rows, 7), seed + 5),  # odd row size: checks the 64-byte padding
        },
    ]
    for i, dtype in enumerate(FLOAT8):
        chunk[1][f"f8_{i}"] = random_tensor(dtype, (rows, 4), seed + 6 + i)
    return chunk


@pytest.fixture
def closing() -> Iterator[list[object]]:
    """Objects with close() that the test made; closed at teardown so no memfd outlives its test."""
    made: list[object] = []
    yield made
    for obj in reversed(made):
        obj.close()  # type: ignore[attr-defined]


def test_shared_memory_is_an_anonymous_memfd(closing: list[object]) -> None:
    mem = SharedMemory(4096, name="gigashuffle-test")
    closing.append(mem)
    assert mem.fd is not None
    assert os.readlink(f"/proc/self/fd/{mem.fd}").startswith("/memfd:gigashuffle-test")
    assert os.fstat(mem.fd).st_size == 4096
    assert not os.get_inheritable(mem.fd)  # MFD_CLOEXEC: children only get it by explicit passing
    assert mem.view(0, 4096).sum().item() == 0  # fresh memory is zeroed


def test_shared_memory_from_a_dup_fd_maps_the_same_bytes(closing: list[object]) -> None:
    first = SharedMemory(8192)
    closing.append(first)
    assert first.fd is not None
    second = SharedMemory(8192, fd=os.dup(first.fd))
    closing.append(second)
    assert second.fd != first.fd

    pattern = torch.arange(8192, dtype=torch.int64).remainder(251).to(torch.uint8)
    first.view(0, 8192).copy_(pattern)
    assert torch.equal(second.view(0, 8192), pattern)
    # Writes through the second mapping are seen through the first, at any offset.
    second.view(4000, 100).fill_(7)
    assert first.view(4000, 100).eq(7).all()
    assert first.numpy_view(3999, 1)[0] == pattern[3999].item()
    assert bytes(second.numpy_view(0, 16)) == bytes(pattern[:16].numpy())


def test_shared_memory_refuses_bad_sizes(closing: list[object]) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        SharedMemory(0)
    small = SharedMemory(100)
    closing.append(small)
    assert small.fd is not None
    fd = os.dup(small.fd)
    try:
        with pytest.raises(ValueError, match="holds 100 bytes, expected 4096"):
            SharedMemory(4096, fd=fd)
    finally:
        os.close(fd)


def test_closed_shared_memory_refuses_new_views_but_old_views_stay_valid() -> None:
    mem = SharedMemory(1024)
    view = mem.view(0, 1024)
    view.fill_(42)
    fd = mem.fd
    mem.close()
    assert mem.fd is None
    with pytest.raises(OSError):
        os.fstat(fd)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="closed"):
        mem.view(0, 8)
    with pytest.raises(ValueError, match="closed"):
        mem.numpy_view(0, 8)
    assert view.eq(42).all()  # the mapping lives as long as a tensor made from it
    mem.close()  # idempotent


def test_shared_memory_collected_without_close_releases_its_fd() -> None:
    """An owner dropped without close() (an error path, a test's table) must not keep the memfd open for the life
    of the process: the unit suite used to end with 53 slot tables' and 17 rings' fds still open in its process."""

    def open_memfds() -> int:
        return sum(target.startswith("/memfd:gigashuffle-collect-test ") for _fd, target in leaks.open_fds())

    memory = SharedMemory(4096, name="gigashuffle-collect-test")
    view = memory.numpy_view(0, 4096)
    assert open_memfds() == 2  # its own, and the mapping's dup
    del memory
    gc.collect()
    assert open_memfds() == 1, "the collected object's fd is still open"
    del view  # the last view: the mapping, and its dup, go
    gc.collect()
    assert open_memfds() == 0


def test_forget_in_a_fork_unmaps_the_memory_even_under_live_views() -> None:
    """``SharedMemory.forget`` (a fork's copy of the trainer's node buffer: NOTE [ Forks of the trainer ]) drops the
    fork's fd and mapping though a view of it lives there; the view's addresses stay reserved, and the parent's
    mapping and bytes are untouched."""
    memory = SharedMemory(1 << 20, name="gigashuffle-forget-test")
    view = memory.numpy_view(0, 1 << 20)
    view[:] = 7
    address = view.ctypes.data

    def in_the_fork() -> int:
        memory.forget()
        maps = Path("/proc/self/maps").read_text().splitlines()
        fds = [target for _fd, target in leaks.open_fds()]
        held = [line for line in maps + fds if "gigashuffle-forget-test" in line]
        reserved = [
            fields[1]
            for fields in (line.split() for line in maps)
            if int(fields[0].split("-")[0], 16) <= address < int(fields[0].split("-")[1], 16)
        ]
        return 0 if not held and memory.fd is None and reserved == ["---p"] else 1

    status = wait_child(fork_child(in_the_fork))
    assert os.waitstatus_to_exitcode(status) == 0, "the fork still holds the memory, or its view's range is free"
    assert memory.fd is not None and int(view.sum()) == 7 << 20  # the parent's are as they were
    del view
    memory.close()


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32, torch.float16, torch.bfloat16, *FLOAT8])
def test_slot_buffer_round_trip_single_dtype(dtype: torch.dtype, closing: list[object]) -> None:
    data = random_tensor(dtype, (10, 3, 3), seed=3)
    layout = Layout.from_chunk([{"x": data}])
    _, fields = layout.rows_in([{"x": data}])
    buf = SlotBuffer(layout, slots=32)
    closing.append(buf)
    slots = torch.tensor([31, 0, 17, 5], dtype=torch.int64)
    buf.write(slots, fields, start=6)  # rows 6..9 -> slots 31, 0, 17, 5
    (got,) = buf.read_rows(torch.tensor([0, 5, 17, 31]))
    assert raw(got) == raw(data[[7, 9, 8, 6]])


def test_slot_buffer_writes_fields_at_any_byte_offset(closing: list[object]) -> None:
    # A user's slice of a wider tensor: 8-byte rows of float32 starting 4 bytes into the storage, which a torch
    # int64 view refuses; the copy must still move exactly those bytes.
    base = random_tensor(torch.float32, (41,), seed=9)
    data = base[1:].reshape(20, 2)
    assert data.storage_offset() * data.element_size() % 8 == 4
    layout = Layout.from_chunk([{"x": data}])
    _, fields = layout.rows_in([{"x": data}])
    buf = SlotBuffer(layout, slots=16)
    closing.append(buf)
    buf.write(np.array([3, 9, 0], dtype=np.int32), fields, start=17)
    (got,) = buf.read_rows(torch.tensor([3, 9, 0]))
    assert raw(got) == raw(data[17:20])


def test_slot_buffer_write_and_gather_are_bytes_exact(closing: list[object]) -> None:
    chunk = make_chunk(12)
    layout = Layout.from_chunk(chunk)
    _, fields = layout.rows_in(chunk)
    buf = SlotBuffer(layout, slots=50)
    closing.append(buf)
    assert buf.nbytes % 64 == 0
    for region in buf.regions:
        assert region.data_ptr() % 64 == 0  # every field region starts on a cache line

    perm = torch.randperm(50, generator=torch.Generator().manual_seed(0))[:12]
    buf.write(perm[:5], fields, start=0)
    buf.write(perm[5:], fields, start=5)
    # Gather in another order than written: slot perm[i] holds row i.
    order = torch.tensor([11, 0, 3, 7, 7, 2])
    out = [torch.empty(len(order), spec.row_bytes, dtype=torch.uint8) for spec in layout.fields]
    buf.gather(perm[order], out)
    for spec, got, src in zip(layout.fields, out, fields, strict=True):
        assert raw(got) == raw(src[order]), spec.label

    # A second buffer over the same memfd sees the same rows.
    assert buf.memory.fd is not None
    twin = SlotBuffer(layout, slots=50, memory=SharedMemory(buf.nbytes, fd=os.dup(buf.memory.fd)))
    closing.append(twin)
    for got, src in zip(twin.read_rows(perm), fields, strict=True):
        assert raw(got) == raw(src)


def test_gather_refuses_slot_ids_outside_the_buffer(closing: list[object]) -> None:
    # The copy itself clips (NOTE [ Row copies ]), so without this check an id past the end would silently
    # deliver the last row.
    chunk = make_chunk(4)
    layout = Layout.from_chunk(chunk)
    buf = SlotBuffer(layout, slots=8)
    closing.append(buf)
    out = [torch.empty(2, spec.row_bytes, dtype=torch.uint8) for spec in layout.fields]
    for bad in ([3, 8], [-1, 2]):
        with pytest.raises(IndexError, match=r"slot ids must lie in \[0, 8\)"):
            buf.gather(np.array(bad), out)
    with pytest.raises(IndexError):
        buf.write(np.array([1, 8]), layout.rows_in(chunk)[1], 0)  # put raises on its own


def test_slot_buffer_fields_do_not_overlap(closing: list[object]) -> None:
    layout = Layout.from_chunk([{"a": torch.zeros(1, 3, dtype=torch.uint8), "b": torch.zeros(1, 5, dtype=torch.uint8)}])
    buf = SlotBuffer(layout, slots=9)
    closing.append(buf)
    buf.regions[0].fill_(0xAA)
    buf.regions[1].fill_(0x55)
    assert buf.regions[0].eq(0xAA).all()
    assert buf.regions[1].eq(0x55).all()


def fill_ring_slot(ring: BatchRing, buf: SlotBuffer, k: int, slots: torch.Tensor) -> None:
    """What a reader does: gather the slots into ring slot ``k`` and record their indices."""
    fields, index = ring.regions(k)
    buf.gather(slots, fields)
    index.copy_(slots)


def test_batch_views_have_the_dataset_dtypes_and_shapes(closing: list[object]) -> None:
    bs = 4
    chunk = make_chunk(16, seed=10)
    layout = Layout.from_chunk(chunk)
    _, fields = layout.rows_in(chunk)
    buf = SlotBuffer(layout, slots=16)
    ring = BatchRing(layout, bs=bs, depth=3)
    closing += [buf, ring]
    assert ring.slot_bytes % 64 == 0
    # and a cache line of per-slot sequence numbers (shm/lanes.py), and one for each way's queue of slots and its
    # wait word (NOTE [ Slot queues ] in shm/slotqueue.py)
    assert ring.nbytes == 3 * ring.slot_bytes + 64 + 64 + 64
    buf.write(torch.arange(16), fields, start=0)  # slot i holds row i

    picks = [torch.tensor([3, 9, 0, 15]), torch.tensor([1, 2, 4, 8]), torch.tensor([14, 13, 12, 11])]
    for k, slots in enumerate(picks):
        fill_ring_slot(ring, buf, k, slots)
    for k, slots in enumerate(picks):  # filling later ring slots left earlier ones intact
        batch = ring.batch(k)
        assert len(batch) == layout.num_groups
        assert list(batch[0]) == ["tokens", "mask", "emb", INDEX_KEY]
        for g, group in enumerate(chunk):
            for key, src in group.items():
                view = batch[g][key]
                assert view.dtype == src.dtype
                assert tuple(view.shape) == (bs, *src.shape[1:])
                assert view.data_ptr() % 64 == 0
                assert raw(view) == raw(src[slots])
        index = batch[0][INDEX_KEY]
        assert index.dtype == torch.int64
        assert tuple(index.shape) == (bs,)
        assert index.tolist() == slots.tolist()


def test_on_release_fires_only_after_every_view_is_gone(closing: list[object]) -> None:
    layout = Layout.from_chunk([{"x": torch.zeros(1, 4)}, {"y": torch.zeros(1, dtype=torch.int64)}])
    ring = BatchRing(layout, bs=8, depth=2)
    closing.append(ring)
    released: list[int] = []

    batch = ring.batch(0, on_release=lambda: released.append(0))
    kept_slice = batch[1]["y"][2:5]
    kept_index = batch[0][INDEX_KEY][:1].view(torch.int32)
    del batch
    gc.collect()
    reclaim()  # the release runs here, never where the views die (NOTE [ Reclaimed ring slots ])
    assert released == []  # a slice the caller kept still points into the ring slot
    del kept_slice
    gc.collect()
    reclaim()  # the release runs here, never where the views die (NOTE [ Reclaimed ring slots ])
    assert released == []  # so does a reinterpreting view of another field
    del kept_index
    gc.collect()
    reclaim()  # the release runs here, never where the views die (NOTE [ Reclaimed ring slots ])
    assert released == [0]


def test_on_release_does_not_wait_for_copies(closing: list[object]) -> None:
    layout = Layout.from_chunk([{"x": torch.zeros(1, 4)}])
    ring = BatchRing(layout, bs=2, depth=2)
    closing.append(ring)
    released: list[int] = []
    batch = ring.batch(1, on_release=lambda: released.append(1))
    copies = [batch[0]["x"].clone(), batch[0][INDEX_KEY].numpy().copy(), batch[0]["x"].tolist()]
    del batch
    gc.collect()
    reclaim()  # the release runs here, never where the views die (NOTE [ Reclaimed ring slots ])
    assert released == [1]
    assert len(copies) == 3


def test_each_batch_has_its_own_release(closing: list[object]) -> None:
    layout = Layout.from_chunk([{"x": torch.zeros(1, 4)}])
    ring = BatchRing(layout, bs=2, depth=2)
    closing.append(ring)
    released: list[int] = []
    first = ring.batch(0, on_release=lambda: released.append(0))
    second = ring.batch(1, on_release=lambda: released.append(1))
    del second
    gc.collect()
    reclaim()  # the release runs here, never where the views die (NOTE [ Reclaimed ring slots ])
    assert released == [1]
    del first
    gc.collect()
    reclaim()  # the release runs here, never where the views die (NOTE [ Reclaimed ring slots ])
    assert released == [1, 0]


def test_batch_stays_readable_after_the_ring_is_closed() -> None:
    layout = Layout.from_chunk([{"x": torch.zeros(1, 2, dtype=torch.int32)}])
    ring = BatchRing(layout, bs=3, depth=2)
    fields, index = ring.regions(1)
    fields[0].view(torch.int32).copy_(torch.arange(6, dtype=torch.int32).reshape(3, 2))
    index.copy_(torch.tensor([5, 6, 7]))
    released: list[int] = []
    batch = ring.batch(1, on_release=lambda: released.append(1))
    ring.close()
    assert batch[0]["x"].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert batch[0][INDEX_KEY].tolist() == [5, 6, 7]
    del batch
    gc.collect()
    reclaim()  # the release runs here, never where the views die (NOTE [ Reclaimed ring slots ])
    assert released == [1]


def test_ring_shared_through_a_dup_fd(closing: list[object]) -> None:
    """The trainer maps a reader's ring from the fd the reader sends: both see the same batch."""
    layout = Layout.from_chunk([{"x": torch.zeros(1, 3, dtype=torch.float16)}])
    writer_side = BatchRing(layout, bs=4, depth=2)
    closing.append(writer_side)
    assert writer_side.memory.fd is not None
    reader_side = BatchRing(
        layout, bs=4, depth=2, memory=SharedMemory(writer_side.nbytes, fd=os.dup(writer_side.memory.fd))
    )
    closing.append(reader_side)
    fields, index = writer_side.regions(1)
    values = torch.randn(4, 3).half()
    fields[0].copy_(values.view(torch.uint8).reshape(4, 6))
    index.copy_(torch.tensor([9, 8, 7, 6]))
    batch = reader_side.batch(1)
    assert raw(batch[0]["x"]) == raw(values)
    assert batch[0][INDEX_KEY].tolist() == [9, 8, 7, 6]


def test_ring_depth_is_the_configured_one_or_8_batches_while_they_fit_the_budget_and_never_below_4() -> None:
    def layout_of(row_bytes: int) -> Layout:
        return Layout.from_chunk([{"x": torch.zeros((1, row_bytes), dtype=torch.uint8)}])

    assert ring_depth_for(3, layout_of(150_528), 256) == 3  # configured: taken as it is
    assert ring_depth_for(None, layout_of(8), 1024) == 8  # tiny rows
    assert ring_depth_for(None, layout_of(8192), 64) == 8  # tokens: 512 KiB batches
    assert ring_depth_for(None, layout_of(RING_BUDGET_BYTES // (6 * 64)), 64) == 6  # six such batches fit
    assert ring_depth_for(None, layout_of(150_528), 256) == 4  # image: 38 MB batches, at least 4 in flight
