"""A rank with ``num_readers=0`` only feeds its node's buffer: its writers' rows reach the reading ranks of the node,
its dummy batch works, and iterating it raises an error that says why."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import torch
from datasets import DEADLINE_S, UniqueIds, check_unique_batch, take, writer_of

from gigashuffle import INDEX_KEY, DataloaderConfig, GigashuffleError, MultiprocessShuffledDataloader


def test_a_writer_only_rank_feeds_the_reading_rank_of_its_node(redis_url: str) -> None:
    common: dict[str, Any] = dict(bs=4, shuffle_size=64, queue_name=f"wonly-{uuid.uuid4().hex[:8]}", num_writers=1,
                                  local_world_size=2, global_world_size=2, redis_url=redis_url)  # fmt: skip
    feeder = MultiprocessShuffledDataloader(UniqueIds(), DataloaderConfig(num_readers=0, **common))
    try:
        assert feeder.child_pids()["reader"] == []
        with pytest.raises(GigashuffleError, match=r"num_readers=0.*only feeds the node's buffer"):
            iter(feeder)
        dummy = feeder.get_dummy_batch()
        assert dummy[0]["id"].shape == (4,) and torch.equal(dummy[0][INDEX_KEY], torch.full((4,), -1))
        reader_cfg = DataloaderConfig(num_readers=1, local_rank=1, global_rank=1, **common)
        with MultiprocessShuffledDataloader(UniqueIds(), reader_cfg) as reader:
            it = iter(reader)
            seen: set[int] = set()
            writers: set[int] = set()
            deadline = time.monotonic() + DEADLINE_S
            while writers != {0, 1}:  # writer 0 belongs to the feeder (rank 0), writer 1 to the reading rank
                assert time.monotonic() < deadline, f"the reading rank saw rows of writers {writers} only"
                ids = check_unique_batch(take(it, 1)[0], 4, 64)
                assert not seen.intersection(ids), "a row was read twice"
                seen.update(ids)
                writers.update(int(writer_of(i)) for i in ids)
            assert writers == {0, 1}
    finally:
        feeder.close()
