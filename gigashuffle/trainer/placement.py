"""Where delivered batches go: the interface the trainer hands batches through, and its CPU case (the ring's views as
they are). Pinned rings and device copies are ``CudaPlacement``'s (NOTE [ GPU placement ] in trainer/pinning.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gigashuffle.shm.ring import BatchRing

Batch = list[dict[str, torch.Tensor]]


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
        """Batch ``k`` of ``ring``; ``release`` returns its slot. If this raises, ``release`` has run or will (the
        slot comes back once nothing can read it): the caller never returns the slot itself."""
        return ring.batch(k, release)

    def clone(self, batch: Batch) -> Batch:
        """A copy of ``batch`` (ring views) in memory of the caller's own: the hand-over when the caller holds most
        of a ring (``Inbox.hand_over``)."""
        return [{key: t.clone() for key, t in group.items()} for group in batch]

    def release_after(self, stream: object) -> None:
        """Copies out of the batches may run on ``stream``: only pinned rings care (``CudaPlacement``)."""

    def poll(self, wait: bool = False) -> int:
        return 0

    def place(self, batch: Batch) -> Batch:
        """``batch`` (the caller's own memory, e.g. the dummy batch) where delivered batches go."""
        return batch

    def close(self) -> None:
        """Release what is left; safe to call twice."""
