"""A hand-over that raises still returns its ring slot (issue 33; NOTE [ A ring slot's walk ] in trainer/inbox.py):
a CUDA OOM in the device copy, a failed wait for a pinned copy, a copy that cannot be allocated, an interrupt, and
the caller's own step that fails on a batch it was handed.
Without a loader: a real ``ChildProcess`` record with a real ring, read as its reader takes the slots given back."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest
import torch
from fakecuda import FakeCuda

from gigashuffle import DataloaderConfig
from gigashuffle.procs.channel import Channel
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import BatchRing
from gigashuffle.trainer.inbox import Inbox
from gigashuffle.trainer.pinning import Batch, CudaPlacement, Placement, placement

DEPTH = 2


@pytest.fixture
def reader() -> Iterator[tuple[ChildProcess, Channel]]:
    ours, theirs = socket.socketpair()
    child = ChildProcess("reader", 0, seq=0, channel=Channel(ours))
    child.ring = BatchRing(Layout.from_chunk([{"id": torch.arange(4, dtype=torch.int64)}]), bs=4, depth=DEPTH)
    yield child, Channel(theirs)
    child.ring.close()


def _returned(child: ChildProcess) -> list[int]:
    """The ring slots the reader got back so far, as its loop takes them (NOTE [ Slot queues ])."""
    assert child.ring is not None
    return child.ring.returns.take()


class _CannotCopy(Placement):
    """Pageable rings, and the copy for a caller that holds the ring fails (out of memory)."""

    def clone(self, batch: Batch) -> Batch:
        raise MemoryError


class _FailingWait(CudaPlacement):
    """Pinned rings whose wait for a pending copy fails (a CUDA error, or an interrupt in the wait)."""

    def __init__(self, error: type[BaseException]) -> None:
        super().__init__(FakeCuda(), 0, moves=False)
        self.error = error

    @property
    def pending(self) -> int:
        return 1

    def poll(self, wait: bool = False) -> int:
        if wait:
            raise self.error
        return 0


def test_a_copy_that_cannot_be_made_for_a_caller_holding_the_ring_returns_the_slot(
    reader: tuple[ChildProcess, Channel],
) -> None:
    child, _theirs = reader
    inbox = Inbox(_CannotCopy(), [child])
    child.held = DEPTH - 1  # the caller holds the rest of the ring: the hand-over is a copy
    with pytest.raises(MemoryError):
        inbox.hand_over(child, 1)
    assert _returned(child) == [1] and child.held == DEPTH - 1


def test_a_batch_the_callers_collate_like_step_fails_on_returns_its_slot(
    reader: tuple[ChildProcess, Channel],
) -> None:
    """The caller's step after ``next()`` (a collate, a transform) raises with the batch in its frame: once the
    exception is handled, nothing holds the batch and the next flush returns its slot."""
    child, _theirs = reader
    inbox = Inbox(Placement(), [child])

    def collate(batch: Batch) -> None:
        raise ValueError(f"the caller's step fails on a batch of {len(batch[0]['id'])} rows")

    for k in (0, 1, 0):  # more failures than the ring is deep
        with contextlib.suppress(ValueError):
            collate(inbox.hand_over(child, k))
        inbox.flush()
        assert _returned(child) == [k] and child.held == 0


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_wait_for_a_pinned_copy_returns_the_slot(
    reader: tuple[ChildProcess, Channel], error: type[BaseException]
) -> None:
    child, _theirs = reader
    inbox = Inbox(_FailingWait(error), [child])
    child.held = DEPTH - 1
    with pytest.raises(error):
        inbox.hand_over(child, 0)
    assert _returned(child) == [0] and child.held == DEPTH - 1


def test_device_mode_out_of_memory_more_times_than_the_ring_is_deep_loses_no_slot(
    reader: tuple[ChildProcess, Channel],
) -> None:
    child, _theirs = reader
    assert child.ring is not None
    cuda = FakeCuda(devices=1)
    place = placement(DataloaderConfig(bs=4, shuffle_size=64, queue_name="q", device="cuda"), cuda)
    place.adopt(child.ring)
    inbox = Inbox(place, [child])
    cuda.fail_copies = 3 * DEPTH
    for n in range(3 * DEPTH):
        with pytest.raises(RuntimeError, match="out of memory"):
            inbox.hand_over(child, n % DEPTH)
        place.poll()
        inbox.flush()
        assert _returned(child) == [n % DEPTH] and child.held == 0
    batch = inbox.hand_over(child, 0)  # and the copies work again
    assert cuda.on_device(batch[0]["id"])
    place.close()
