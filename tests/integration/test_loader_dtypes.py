"""Every supported dtype goes through the buffer bit-exactly, from tensors or numpy arrays, in chunks of any
size, with one or several groups of fields."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from datasets import DTYPES, AllDtypes, check_dtype_batch, dtype_chunk, dtype_key, dtype_values, take

from gigashuffle import INDEX_KEY, DataloaderConfig, MultiprocessShuffledDataloader


def test_the_dataset_helpers_round_trip() -> None:
    """The expected values are exact in their dtype (so a mismatch in a loader test is the loader's)."""
    ids = np.arange(0, 5000, 37, dtype=np.int64)
    chunk = dtype_chunk(ids, as_numpy=False, groups=2)
    for dtype in DTYPES:
        field = chunk[0][dtype_key(dtype)]
        assert field.dtype == dtype
        back = field.float().numpy() if dtype == torch.bfloat16 else field.numpy()
        np.testing.assert_array_equal(back, dtype_values(ids, dtype))
    assert dtype_values(ids, torch.uint64).min() >= 2**63


@pytest.mark.parametrize(
    ("as_numpy", "groups"),
    [(False, 1), (True, 1), (False, 2), (True, 2)],
    ids=["tensors", "numpy", "tensors-2groups", "numpy-2groups"],
)
def test_every_dtype_round_trips_exactly(redis_url: str, as_numpy: bool, groups: int) -> None:
    bs, slots = 8, 128
    cfg = DataloaderConfig(
        bs=bs, shuffle_size=slots, queue_name=f"dtypes-{uuid.uuid4().hex[:8]}", num_writers=2, num_readers=1,
        redis_url=redis_url,
    )  # fmt: skip
    # Chunk sizes vary from chunk to chunk: 1 row, 7, 33 (more than a batch), ...
    dataset = AllDtypes(sizes=(1, 7, 33, 2, 16, 3), as_numpy=as_numpy, groups=groups)
    seen: set[int] = set()
    with MultiprocessShuffledDataloader(dataset, cfg) as loader:
        dummy = loader.get_dummy_batch()
        assert len(dummy) == groups
        for key, value in dummy[0].items():
            if key != INDEX_KEY:
                assert value.dtype == (torch.int64 if key == "id" else dict((dtype_key(d), d) for d in DTYPES)[key])
        check_dtype_batch([{**g} for g in dummy], bs, groups)  # the first row, bs times, exact too
        for batch in take(iter(loader), 40):
            ids = check_dtype_batch(batch, bs, groups)
            index = batch[0][INDEX_KEY]
            assert index.dtype == torch.int64 and bool((index >= 0).all()) and bool((index < slots).all())
            assert not seen.intersection(ids.tolist())
            seen.update(ids.tolist())
    # Rows of chunks of every size arrived (ids are consecutive per writer, so sizes show as id ranges).
    per_writer = {i % 10**8 for i in seen}
    assert max(per_writer) >= 1 + 7 + 33, "rows beyond the first chunks were delivered"
