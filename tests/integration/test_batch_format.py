"""Batches that drop into a model: a plain dict, the index key left out, len() from steps_per_epoch, and
set_epoch() reaching the dataset in every writer, also in one started again after a death."""

from __future__ import annotations

import itertools
import os
import signal
import time
import uuid
from typing import Any

import pytest
import torch
from datasets import DEADLINE_S, AllDtypes, EpochEcho, UniqueIds, poll, take

from gigashuffle import INDEX_KEY, DataloaderConfig, MultiprocessShuffledDataloader

RESPAWN_S = min(DEADLINE_S, 120.0)


def _config(redis_url: str, **overrides: Any) -> DataloaderConfig:
    settings: dict[str, Any] = dict(
        bs=4, shuffle_size=64, queue_name=f"fmt-{uuid.uuid4().hex[:8]}", num_writers=1, num_readers=1,
        redis_url=redis_url, min_mixing=0.1,
    )  # fmt: skip
    settings.update(overrides)
    return DataloaderConfig(**settings)


def test_dict_batches_without_index_key(redis_url: str) -> None:
    cfg = _config(redis_url, batch_format="dict", index_key=False)
    with MultiprocessShuffledDataloader(UniqueIds(), cfg) as loader:
        for batch in take(iter(loader), 5):
            assert isinstance(batch, dict) and set(batch) == {"id", "x", "y"}
            assert torch.equal(batch["x"], batch["id"].unsqueeze(1).expand(4, 3))  # not torn
        dummy = loader.get_dummy_batch(timeout_s=DEADLINE_S)
        assert isinstance(dummy, dict) and INDEX_KEY not in dummy


def test_dict_batches_keep_the_index_by_default(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, batch_format="dict")) as loader:
        batch = next(iter(loader))
        assert set(batch) == {"id", "x", "y", INDEX_KEY}


def test_batch_size_is_bs_under_torchs_name_and_read_only(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, batch_format="dict", bs=8)) as loader:
        assert loader.batch_size == 8
        assert len(next(iter(loader))["id"]) == loader.batch_size
        with pytest.raises(AttributeError):
            loader.batch_size = 4  # type: ignore[misc]
        assert loader.batch_size == loader.config.bs == 8


def test_dict_batches_refuse_chunks_of_two_groups(redis_url: str) -> None:
    loader = MultiprocessShuffledDataloader(AllDtypes(groups=2), _config(redis_url, batch_format="dict"))
    with loader, pytest.raises(ValueError, match=r"batch_format='dict'.*2 groups.*batch_format='list'"):
        next(iter(loader))


def test_steps_per_epoch_gives_len_and_ends_each_iteration(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, steps_per_epoch=3)) as loader:
        assert len(loader) == 3
        seen: list[int] = []
        for _epoch in range(2):
            batches = list(itertools.islice(iter(loader), 4))  # an endless epoch fails here, without a hang
            assert len(batches) == 3
            seen += [int(i) for b in batches for i in b[0]["id"]]
        assert len(seen) == len(set(seen)) == 24  # the second epoch goes on with new rows


def test_len_without_steps_per_epoch_is_a_type_error(redis_url: str) -> None:
    loader = MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url))
    with loader, pytest.raises(TypeError, match="steps_per_epoch"):
        len(loader)


def test_set_epoch_reaches_every_writer_and_a_restarted_one(redis_url: str) -> None:
    cfg = _config(redis_url, num_writers=2, max_restarts=1)
    with MultiprocessShuffledDataloader(EpochEcho(), cfg) as loader:
        it = iter(loader)
        next(it)
        loader.set_epoch(7)
        # Rows written before the call drain first; then every writer's rows carry the epoch.
        batch = poll(it, lambda b: bool((b[0]["epoch"] == 7).all()), "epoch 7 in a whole batch")
        assert set(int(w) for w in batch[0]["id"] // 10**8) <= {0, 1}
        writers: set[int] = set()
        poll(it, lambda b: bool(writers.update(_writers_with_epoch(b, 7))) or writers == {0, 1}, "both writers at 7")
        before = set(loader.child_pids()["writer"])  # both took set_epoch(7) while running
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        pids = loader.child_pids
        poll(it, lambda _b: victim not in pids()["writer"] and len(pids()["writer"]) == 2, "the writer started again")
        (respawned,) = set(pids()["writer"]) - before
        assert loader.metrics().restarts == 1
        # Its rows carry the epoch from its first chunk on (its spec has it). Rows of the writers before it may still
        # be in the buffer, drawn at random, some from before set_epoch (-1): those are not its rows.
        epochs: list[int] = []
        deadline = time.monotonic() + RESPAWN_S
        while len(epochs) < 20:
            assert time.monotonic() < deadline, f"the respawned writer's rows did not come within {RESPAWN_S:.0f} s"
            group = next(it)[0]
            for pid, epoch in zip(group["pid"].tolist(), group["epoch"].tolist(), strict=True):
                assert pid in before or pid == respawned, f"a row of pid {pid}, no writer of this loader"
                if pid == respawned:
                    epochs.append(epoch)
        assert set(epochs) == {7}, f"the respawned writer yielded epochs {sorted(set(epochs))}, not only 7"


def _writers_with_epoch(batch: list[dict[str, torch.Tensor]], epoch: int) -> set[int]:
    group = batch[0]
    return {int(i) // 10**8 for i, e in zip(group["id"], group["epoch"], strict=True) if int(e) == epoch}


def test_set_epoch_checks_its_argument(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url)) as loader:
        with pytest.raises(ValueError, match=r"epoch=-1.*>= 0"):
            loader.set_epoch(-1)
        with pytest.raises(TypeError, match="int"):
            loader.set_epoch("1")  # type: ignore[arg-type]
        loader.set_epoch(2)  # a dataset without set_epoch is left alone
        assert loader.epoch == 2
        next(iter(loader))
