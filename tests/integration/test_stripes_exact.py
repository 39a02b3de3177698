"""A loader over a slot table in stripes (NOTE [ Stripes ] in shm/stripes.py: 32,768 slots make two): every row
once, and a checkpoint's resume exact, as with one stripe."""

from __future__ import annotations

import collections
import time
import uuid
from typing import Any

import pytest
from checkpoint_job import FiniteIds
from datasets import take

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader

SLOTS = 32768
IDS = 60000
CHUNK = 2048


def _config(redis_url: str, **overrides: Any) -> DataloaderConfig:
    settings: dict[str, Any] = dict(bs=256, shuffle_size=SLOTS, queue_name=f"stripes-{uuid.uuid4().hex[:8]}",
                                    num_writers=1, num_readers=2, redis_url=redis_url, lock_stripes=2)  # fmt: skip
    settings.update(overrides)
    return DataloaderConfig(**settings)


def _read_pass(loader: MultiprocessShuffledDataloader, before: list[int]) -> None:
    """Read until every id of pass 0 has come (the buffer drains its last ones while pass 1 streams in): with
    ``before`` (its ids read before), every id of pass 0 must come exactly once."""
    it = iter(loader)
    seen = collections.Counter(before)
    deadline = time.monotonic() + 120
    while len(seen) < IDS and time.monotonic() < deadline:
        for batch in take(it, 16):
            passes = batch[0]["pass"]
            seen.update(batch[0]["id"][passes == 0].tolist())
    assert sorted(seen) == list(range(IDS)), f"lost {sorted(set(range(IDS)) - set(seen))[:10]}"
    assert max(seen.values()) == 1, f"twice: {[i for i, n in seen.items() if n > 1][:10]}"


@pytest.mark.parametrize("way", ["saved", "positions"])
def test_a_striped_table_delivers_every_row_once_across_a_checkpoint(redis_url: str, way: str) -> None:
    cfg = _config(redis_url, checkpoint_rows=way)
    with MultiprocessShuffledDataloader(FiniteIds(IDS, CHUNK), cfg) as loader:
        before = [int(i) for b in take(iter(loader), 40) for i in b[0]["id"]]
        table = loader._sup.table()
        assert table is not None and table.stripes == 2, "the node's table has the stripes the config asks for"
        state = loader.state_dict()
    with MultiprocessShuffledDataloader(FiniteIds(IDS, CHUNK), cfg) as again:
        again.load_state_dict(state)
        _read_pass(again, before)
