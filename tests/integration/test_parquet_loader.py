"""A loader over parquet shards that pandas wrote with a list column (issue 35, item 5): the writers read it with
``ParquetReader`` and every batch carries it as a ``(bs, length)`` field, each row whole."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from datasets import take

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.sources import ParquetReader, Sharded

pytestmark = pytest.mark.timeout(300)

ROWS, LENGTH = 40, 4


def test_a_loader_delivers_a_pandas_list_column_as_a_tensor_field(tmp_path: Path, redis_url: str) -> None:
    shards = []
    for shard in range(2):
        labels = np.arange(ROWS) + shard * ROWS
        features = [np.full(LENGTH, float(label)) + np.arange(LENGTH) / 10 for label in labels]
        shards.append(str(tmp_path / f"train-{shard}.parquet"))
        pd.DataFrame({"features": features, "label": labels}).to_parquet(shards[-1], row_group_size=16)
    config = DataloaderConfig(
        bs=8, shuffle_size=32, queue_name=f"pq-{uuid.uuid4().hex[:8]}", num_writers=2, num_readers=1,
        redis_url=redis_url, batch_format="dict", index_key=False,
    )  # fmt: skip
    dataset = Sharded(shards, ParquetReader(["features", "label"]), rows=8)
    with MultiprocessShuffledDataloader(dataset, config) as loader:
        for batch in take(iter(loader), 6):
            features, labels = batch["features"], batch["label"]
            assert features.dtype == torch.float64 and features.shape == (8, LENGTH)
            expected = labels.to(torch.float64).unsqueeze(1) + torch.arange(LENGTH, dtype=torch.float64) / 10
            assert torch.equal(features, expected), (features, labels)  # each row whole, with its own label
