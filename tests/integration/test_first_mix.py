"""Mixing from the first batch (NOTE [ First mix ] in procs/firstmix.py): the readers' first batches already hold
rows of every writer of the node, even when one writer's source starts late."""

from __future__ import annotations

import uuid

import pytest
from datasets import LateUniqueIds, check_unique_batch, take, writer_of

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader

BS, SHUFFLE, BATCHES = 64, 4096, 1000


@pytest.mark.parametrize("late_s", [0.0, 2.0], ids=["both-fast", "one-late"])
def test_the_first_batches_mix_every_writer(redis_url: str, late_s: float) -> None:
    cfg = DataloaderConfig(
        bs=BS, shuffle_size=SHUFFLE, queue_name=f"mix-{uuid.uuid4().hex[:8]}", num_writers=2, num_readers=2,
        redis_url=redis_url,
    )  # fmt: skip
    with MultiprocessShuffledDataloader(LateUniqueIds(chunk=64, late=(1,), late_s=late_s), cfg) as loader:
        writers = []
        for batch in take(iter(loader), BATCHES):
            ids = check_unique_batch(batch, BS, SHUFFLE)
            writers.append(sorted({int(writer_of(i)) for i in ids}))
    single = [(n, w) for n, w in enumerate(writers) if w != [0, 1]]
    assert not single, f"{len(single)} of the first {BATCHES} batches lack a writer (batch, writers): {single[:10]}"
