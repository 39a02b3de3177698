"""The dummy batch is the first row of writer 0 of the node's first rank, whichever writer created the buffer
(NOTE [ Dummy row ] in gigashuffle/dummy.py)."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import redis
import torch
from datasets import DEADLINE_S, ID_STRIDE
from gpu_datasets import LateWriters
from redis_servers import wait_until

from gigashuffle import INDEX_KEY, DataloaderConfig, GigashuffleError, MultiprocessShuffledDataloader
from gigashuffle.control.keys import QueueKeys


def _queue(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def _publisher_first_id(redis_url: str, queue: str, node: str) -> int:
    """The id of the first row the buffer's creator put in the metadata (what the dummy batch used to show)."""
    with redis.Redis.from_url(redis_url) as client:
        first_row = client.hget(QueueKeys(queue, node).meta, "first_row")
    assert first_row is not None
    return int(np.frombuffer(first_row[:8], dtype=np.int64)[0])  # "id" is the first field of the row


def _check_dummy(dummy: list[dict[str, torch.Tensor]], bs: int, first_id: int) -> None:
    group = dummy[0]
    assert torch.equal(group["id"], torch.full((bs,), first_id, dtype=torch.int64))
    assert torch.equal(group["x"], torch.full((bs, 3), first_id, dtype=torch.int64))
    assert torch.equal(group["y"], torch.full((bs,), -first_id, dtype=torch.float64))
    assert torch.equal(group[INDEX_KEY], torch.full((bs,), -1, dtype=torch.int64))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dummy_batch_is_writer_0s_first_row_when_writer_1_creates_the_buffer(redis_url: str, seed: int) -> None:
    queue, bs = _queue("dummy-w0"), 4
    cfg = DataloaderConfig(
        bs=bs, shuffle_size=64, queue_name=queue, num_writers=2, num_readers=1, seed=seed, redis_url=redis_url
    )
    with MultiprocessShuffledDataloader(LateWriters(redis_url, queue, cfg.node, late=frozenset({0})), cfg) as loader:
        dummy = loader.get_dummy_batch(timeout_s=DEADLINE_S)
        # Writer 0 waited for the buffer, so writer 1 created it: the metadata holds writer 1's first row.
        assert _publisher_first_id(redis_url, queue, cfg.node) == 1 * ID_STRIDE
        _check_dummy(dummy, bs, 0)
        _check_dummy(loader.get_dummy_batch(timeout_s=DEADLINE_S), bs, 0)


@pytest.mark.parametrize(
    ("asker", "first_id"),
    [
        ("rank 1 of node 0", 0),  # writer 0 of global rank 0: worker id 0
        ("rank 3 of node 1", 2 * 2 * ID_STRIDE),  # writer 0 of global rank 2 (node 1's first rank): worker id 4
    ],
)
def test_every_rank_of_a_node_gets_writer_0_of_the_nodes_first_rank(redis_url: str, asker: str, first_id: int) -> None:
    node_first = 0 if asker.endswith("node 0") else 2
    queue, bs = _queue("dummy-ranks"), 4
    common: dict[str, Any] = dict(bs=bs, shuffle_size=64, queue_name=queue, num_writers=2, num_readers=1,
                                  local_world_size=2, global_world_size=4, redis_url=redis_url)  # fmt: skip
    late = frozenset({node_first * 2})  # writer 0 of the node's first rank
    second = DataloaderConfig(local_rank=1, global_rank=node_first + 1, **common)
    dataset = LateWriters(redis_url, queue, second.node, late=late)
    # The second rank starts first and its writers create the buffer; the first rank's writer 0 comes last.
    first = DataloaderConfig(local_rank=0, global_rank=node_first, **common)
    with MultiprocessShuffledDataloader(dataset, second) as other, MultiprocessShuffledDataloader(dataset, first):
        dummy = other.get_dummy_batch(timeout_s=DEADLINE_S)
        assert _publisher_first_id(redis_url, queue, second.node) != first_id
        _check_dummy(dummy, bs, first_id)


def test_dummy_batch_falls_back_to_the_buffers_first_row_when_writer_0_has_no_rows(redis_url: str) -> None:
    queue, bs = _queue("dummy-empty"), 4
    cfg = DataloaderConfig(
        bs=bs, shuffle_size=64, queue_name=queue, num_writers=2, num_readers=1, writer_max_retries=2,
        redis_url=redis_url,
    )  # fmt: skip
    dataset = LateWriters(redis_url, queue, cfg.node, late=frozenset(), empty=frozenset({0}))
    with MultiprocessShuffledDataloader(dataset, cfg) as loader:
        _check_dummy(loader.get_dummy_batch(timeout_s=DEADLINE_S), bs, 1 * ID_STRIDE)


def test_a_forged_dummy_row_is_refused(redis_url: str) -> None:
    """A row forged in Redis before the loader read it is refused; one forged after is never read (the loader
    keeps the verified row it read first, so the dummy batch cannot change under a running job)."""
    queue, bs = _queue("dummy-forged"), 4
    cfg = DataloaderConfig(bs=bs, shuffle_size=64, queue_name=queue, num_writers=1, num_readers=1, redis_url=redis_url)
    key = QueueKeys(queue, cfg.node).dummy

    def forge() -> None:
        with redis.Redis.from_url(redis_url) as client:
            wait_until(lambda: client.hexists(key, "row"), timeout_s=DEADLINE_S, what="the dummy row in Redis")
            row = client.hget(key, "row")
            assert row is not None
            client.hset(key, "row", np.int64(7).tobytes() + row[8:])

    with MultiprocessShuffledDataloader(LateWriters(redis_url, queue, cfg.node, late=frozenset()), cfg) as loader:
        forge()
        with pytest.raises(GigashuffleError, match=r"dummy row .* fails its HMAC check"):
            loader.get_dummy_batch(timeout_s=DEADLINE_S)
    queue = _queue("dummy-forged-late")
    cfg = DataloaderConfig(bs=bs, shuffle_size=64, queue_name=queue, num_writers=1, num_readers=1, redis_url=redis_url)
    key = QueueKeys(queue, cfg.node).dummy
    with MultiprocessShuffledDataloader(LateWriters(redis_url, queue, cfg.node, late=frozenset()), cfg) as loader:
        _check_dummy(loader.get_dummy_batch(timeout_s=DEADLINE_S), bs, 0)
        forge()
        _check_dummy(loader.get_dummy_batch(timeout_s=DEADLINE_S), bs, 0)
