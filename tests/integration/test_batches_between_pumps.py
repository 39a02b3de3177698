"""``next()`` takes announced batches from the rings between pumps, and pumps at least every ``PUMP_EVERY_S``
(NOTE [ Batches between pumps ] in trainer/batches.py), on a real loader."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from datasets import UniqueIds
from timing import deadline

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.trainer import batches


def _loader(redis_url: str) -> MultiprocessShuffledDataloader:
    cfg = DataloaderConfig(bs=4, shuffle_size=64, queue_name=f"between-{uuid.uuid4().hex[:8]}", num_writers=1,
                           num_readers=1, ring_depth=4, redis_url=redis_url)  # fmt: skip
    return MultiprocessShuffledDataloader(UniqueIds(), cfg)


def _with_a_batch_in_the_ring(loader: MultiprocessShuffledDataloader) -> Iterator[Any]:
    """The loader's iterator, once no batch is ready in the trainer and the reader announced one in its ring."""
    it = iter(loader)
    next(it)
    sup = loader._sup
    while sup.inbox.ready:
        next(it)  # dropped at once: its slot goes back to the reader at the next call
    next(it)  # gives the dropped slots back, so that the reader has free ones to gather into
    while sup.inbox.ready:
        next(it)
    ring = sup.readers()[0].ring
    assert ring is not None
    with deadline(60, "the reader's next announcement"):
        while not ring.announcements.has_puts():
            time.sleep(0.001)
    return it


def test_next_takes_a_batch_announced_in_the_ring_without_a_pump(redis_url: str, monkeypatch: Any) -> None:
    monkeypatch.setattr(batches, "PUMP_EVERY_S", 3600.0)  # every pump is recent enough
    with _loader(redis_url) as loader:
        it = _with_a_batch_in_the_ring(loader)
        pumps = loader._sup.pumps
        batch = next(it)
        assert loader._sup.pumps == pumps, "next() pumped for a batch that was in the ring"
        assert len(batch[0]["id"]) == 4


def test_next_pumps_once_the_last_pump_is_older_than_the_bound(redis_url: str, monkeypatch: Any) -> None:
    monkeypatch.setattr(batches, "PUMP_EVERY_S", 0.0)  # every pump is too old: the ring waits for one
    with _loader(redis_url) as loader:
        it = _with_a_batch_in_the_ring(loader)
        pumps = loader._sup.pumps
        next(it)
        assert loader._sup.pumps > pumps, "next() went on from the rings past the bound without a pump"
