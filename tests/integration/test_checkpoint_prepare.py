"""A checkpoint's pause is the copy and nothing else (NOTE [ Checkpoint cut ], checkpoint/savedrows.py): the rank that
copies the buffer maps it with the slot table, long before a checkpoint, and the arrays made ready before the pause
hold the rows saved (tests/unit/test_savedrows.py checks that they are shrunk in place)."""

from __future__ import annotations

import uuid

from datasets import Counter, UniqueIds, take

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader


def _config(redis_url: str) -> DataloaderConfig:
    return DataloaderConfig(bs=4, shuffle_size=256, queue_name=f"prep-{uuid.uuid4().hex[:8]}", num_writers=1,
                            num_readers=1, redis_url=redis_url)  # fmt: skip


def test_the_buffer_is_mapped_before_the_first_checkpoint_and_saved_rows_have_no_surplus(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(Counter(chunk=8), _config(redis_url)) as loader:
        batches = iter(loader)
        take(batches, 5)
        assert loader._sup.node_table._buffer is not None, "the buffer is mapped at the first checkpoint's pause"
        for _ in range(2):  # the first checkpoint faults the buffer in, the second finds it so
            rows = loader.state_dict()["rank0"]["rows"]
            assert rows["count"] > 0
            for field in rows["fields"]:
                # The estimate's surplus rows are not part of what torch.save writes.
                assert field.untyped_storage().nbytes() == rows["count"] * field.shape[1]
            take(batches, 5)


def test_a_loader_that_cannot_checkpoint_does_not_map_the_buffer(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), _config(redis_url)) as loader:
        take(iter(loader), 5)
        assert loader._sup.table() is not None
        assert loader._sup.node_table._buffer is None
