"""Writer seeds as torch's DataLoader gives them (NOTE [ Seeds ] in procs/seeds.py), seen from inside real writers:
``seed + worker id`` for random, numpy, torch and ``get_worker_info().seed``; the same streams for the same seed; a
fresh stream for a respawned writer; and a default seed that the ranks agree on and that is logged."""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from datasets import DEADLINE_S, SeedEcho, take

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.procs.seeds import RESTART_COUNT_ENV, RUN_ID_ENV

Batch = list[dict[str, Any]]
FIELDS = ("seed", "initial", "py", "np", "pt")


def _config(redis_url: str, **overrides: Any) -> DataloaderConfig:
    settings: dict[str, Any] = dict(
        bs=4, shuffle_size=32, queue_name=f"seed-{uuid.uuid4().hex[:8]}", num_writers=2, num_readers=1,
        redis_url=redis_url, seed=1234,
    )  # fmt: skip
    settings.update(overrides)
    return DataloaderConfig(**settings)


def _rows(batch: Batch) -> Iterator[tuple[int, tuple[int, ...]]]:
    group = batch[0]
    for i in range(len(group["wid"])):
        yield int(group["wid"][i]), tuple(int(group[key][i]) for key in FIELDS)


def _streams(it: Iterator[Batch], wids: set[int]) -> dict[int, tuple[int, ...]]:
    """What each writer of ``wids`` reported (its seeds and first draws), read until every one has shown up."""
    found: dict[int, tuple[int, ...]] = {}
    deadline = time.monotonic() + DEADLINE_S
    while set(found) != wids:
        assert time.monotonic() < deadline, f"writers seen: {sorted(found)} of {sorted(wids)}"
        for wid, values in _rows(take(it, 1)[0]):
            assert found.setdefault(wid, values) == values, f"writer {wid} changed its stream without a respawn"
    return found


def test_the_same_seed_gives_the_same_streams_and_a_respawn_a_fresh_one(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(SeedEcho(), _config(redis_url)) as loader:
        first = _streams(iter(loader), {0, 1})
    for wid, (seed, initial, *_draws) in first.items():
        assert seed == 1234 + wid and initial == seed, first
    assert first[0][2:] != first[1][2:], "two writers drew the same numbers"

    with MultiprocessShuffledDataloader(SeedEcho(), _config(redis_url, max_restarts=2)) as loader:
        it = iter(loader)
        assert _streams(it, {0, 1}) == first, "the same seed must give every writer the same stream"
        victim = next(info["pid"] for info in loader.processes().values()
                      if info["role"] == "writer" and info["index"] == 0)  # fmt: skip
        os.kill(victim, signal.SIGKILL)
        respawned = None
        deadline = time.monotonic() + DEADLINE_S
        while respawned is None:
            assert time.monotonic() < deadline, "no row from the respawned writer 0"
            respawned = next((v for wid, v in _rows(take(it, 1)[0]) if wid == 0 and v != first[0]), None)
    seed, initial, *draws = respawned
    assert seed == 1234 + 0 + 1 * 2 and initial == seed, respawned  # seed + worker id + start * num_workers
    assert draws != list(first[0][2:]), "the respawned writer replays its predecessor's stream"
    assert seed != first[1][0], "the respawned writer took another writer's seed"

    with MultiprocessShuffledDataloader(SeedEcho(), _config(redis_url, seed=99)) as loader:
        other = _streams(iter(loader), {0, 1})
    assert other[0][0] == 99 and other[0][2:] != first[0][2:]


def test_the_default_seed_is_agreed_by_the_ranks_of_a_node_and_logged(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    queue = f"seed-node-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = dict(queue_name=queue, local_world_size=2, global_world_size=2, num_writers=1,
                                  shuffle_size=64, seed=None)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="gigashuffle.trainer.childspecs"):
        rank0 = MultiprocessShuffledDataloader(SeedEcho(), _config(redis_url, **common))
        try:
            rank1 = MultiprocessShuffledDataloader(
                SeedEcho(), _config(redis_url, **common, local_rank=1, global_rank=1)
            )
            try:
                assert rank0.seed == rank1.seed
                seeds = _streams(iter(rank1), {0, 1})
                assert {wid: values[0] for wid, values in seeds.items()} == {0: rank0.seed, 1: rank0.seed + 1}
            finally:
                rank1.close()
        finally:
            rank0.close()
    assert f"queue {queue!r} rank 0: seed {rank0.seed} (from the session of node 'n0')" in caplog.text
    with MultiprocessShuffledDataloader(SeedEcho(), _config(redis_url, seed=None)) as another_job:
        assert another_job.seed != rank0.seed, "the default seed must be drawn per job"


def test_under_torchrun_ranks_on_different_nodes_agree_on_the_default_seed(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RUN_ID_ENV, f"job-{uuid.uuid4().hex}")
    monkeypatch.setenv(RESTART_COUNT_ENV, "0")
    queue = f"seed-run-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = dict(queue_name=queue, global_world_size=2, num_writers=1, seed=None)
    # One rank per node: two sessions with two generations, which must not matter.
    with (
        MultiprocessShuffledDataloader(SeedEcho(), _config(redis_url, **common)) as node0,
        MultiprocessShuffledDataloader(SeedEcho(), _config(redis_url, **common, global_rank=1)) as node1,
    ):
        assert node0.seed == node1.seed
        assert _streams(iter(node1), {1})[1][0] == node0.seed + 1
