"""Shards of different lengths read at one rate per row through a real loader (issue 35, item 3; NOTE
[ Balanced pieces ] in gigashuffle/sources/shardcursor.py). Counted, not timed: with ``fill_once`` and the first-mix
cap (NOTE [ First mix ]) each of the 2 writers puts exactly its first half-buffer of rows into the one pass, so the
pass holds each writer's first 128 rows of its stream."""

from __future__ import annotations

import collections
import uuid
from pathlib import Path

import numpy as np
import pytest
from datasets import DEADLINE_S

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.sources import NpyReader, Sharded

pytestmark = pytest.mark.timeout(120)

STRIDE = 1000


@pytest.mark.parametrize("balance", [True, False], ids=["balanced", "whole-shards"])
def test_shards_of_1x_and_3x_rows_are_read_at_one_rate_per_row(tmp_path: Path, redis_url: str, balance: bool) -> None:
    lengths = [64, 192]  # 1x and 3x rows: 256 rows, one buffer of them
    shards = []
    for shard, n in enumerate(lengths):
        shards.append(str(tmp_path / f"s{shard}.npy"))
        np.save(shards[-1], np.arange(n, dtype=np.int64) + shard * STRIDE)
    config = DataloaderConfig(
        bs=16, shuffle_size=sum(lengths), queue_name=f"balance-{uuid.uuid4().hex[:8]}", num_writers=2, num_readers=1,
        fill_once=True, min_mixing=1.0, first_mix_wait_s=DEADLINE_S, redis_url=redis_url,
    )  # fmt: skip
    dataset = Sharded(shards, NpyReader("id"), rows=16, shuffle_shards=False, balance=balance)
    with MultiprocessShuffledDataloader(dataset, config) as loader:
        ids = [i for batch in loader for i in batch[0]["id"].tolist()]
    assert len(ids) == sum(lengths), "one fill_once pass: the buffer's rows once"
    per_shard = collections.Counter(i // STRIDE for i in ids)
    rates = [per_shard[s] / n for s, n in enumerate(lengths)]  # rows delivered per row of the shard
    if balance:
        assert max(rates) <= 1.1 * min(rates), f"rows delivered per row of each shard: {rates}"
        assert sorted(ids) == sorted(s * STRIDE + r for s, n in enumerate(lengths) for r in range(n))
    else:  # the skew balance=False documents: the 1x shard's writer read it twice while the other read 2/3 of its
        assert rates == [2.0, 128 / 192], rates
