"""A process's second loader forks its children from the zygote the first one parked (NOTE [ Reused zygotes ] in
procs/zygotereuse.py): the first loader's children are all dead once it closed, and the second's children run with
the environment the second loader was made in, as children of a fresh zygote would."""

from __future__ import annotations

import uuid

import pytest
from datasets import EnvEcho

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.host.pids import pid_alive
from gigashuffle.procs.zygotereuse import parked_zygote_pid


def _marks(cfg: DataloaderConfig) -> tuple[dict[str, list[int]], set[int]]:
    """The loader's process pids and the marks of its first 20 batches."""
    with MultiprocessShuffledDataloader(EnvEcho(), cfg) as loader:
        pids = loader.child_pids()
        marks: set[int] = set()
        for _, batch in zip(range(20), loader, strict=False):
            marks |= set(batch[0]["mark"].tolist())
    return pids, marks


def test_a_second_loader_reuses_the_zygote_with_its_own_environment(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = DataloaderConfig(bs=4, shuffle_size=64, queue_name=f"reuse-{uuid.uuid4().hex[:8]}", num_writers=2,
                           num_readers=1, redis_url=redis_url)  # fmt: skip
    monkeypatch.setenv("GS_TEST_MARK", "1")
    first, marks = _marks(cfg)
    assert marks == {1}
    dead = [pid for role in ("writer", "reader") for pid in first[role] if pid_alive(pid)]
    assert not dead, f"children of the closed loader still run: {dead}"
    assert parked_zygote_pid() == first["zygote"][0]

    monkeypatch.setenv("GS_TEST_MARK", "2")  # read by the children at run time: it must reach them
    second, marks = _marks(cfg)
    assert second["zygote"] == first["zygote"], "the second loader started a zygote of its own"
    assert not set(second["writer"]) & set(first["writer"])
    assert marks == {2}, f"the reused zygote's children saw the first loader's environment: marks {marks}"
