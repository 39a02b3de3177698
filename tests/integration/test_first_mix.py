"""Mixing from the first batch (NOTE [ First mix ] in procs/firstmix.py): the readers' first batches already hold
rows of every writer of the node, even when one writer's source starts late."""

from __future__ import annotations

import uuid

import pytest
from datasets import LateUniqueIds, check_unique_batch, take, writer_of

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader

# The first-mix promise covers the start: without it, the first 300-400 batches came from one writer. Later batches
# mix as the writers' relative rates allow, which scheduling decides: a writer descheduled for a second on a loaded
# 2-core machine lets the other one refill the buffer alone (after ~8,000 rows drawn without it, one batch of 64 in
# a hundred lacks it). Within the first 50 batches (3,200 rows of a 4,096-slot buffer) at least a quarter of the
# rows stay from each writer even if one stops at once after the threshold, so a batch lacking one is a ~1e-7 event.
BS, SHUFFLE, BATCHES = 64, 4096, 50


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
