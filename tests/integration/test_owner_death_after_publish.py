"""The buffer's owner dies right after its publication won, before it said ``Attached`` (NOTE [ The trainer holds
the buffer ] in trainer/nodetable.py). It sent the buffer's and the table's memfds to the trainer before it
published them, so the trainer serves them and the respawned writer and the reader attach. When the fds came with
``Attached`` instead, nobody served the published buffer: every child waited ``redis_timeout_s``, died with
``AttachError``, and the loader failed once the writer was out of restarts."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from datasets import ProcessIds, check_unique_batch, take
from leaks import open_fds

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader


@pytest.mark.parametrize("writers", [1, 2])
def test_a_buffer_whose_owner_died_right_after_publishing_it_is_still_served(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writers: int
) -> None:
    killed, met = tmp_path / "owner-killed", tmp_path / "met"
    met.mkdir()
    # The first writer whose publication wins SIGKILLs itself at once (the marker keeps its successor alive). With
    # two writers, both make a buffer and offer it before either publishes (a barrier), so one offer loses. The
    # zygote reads the fail points when it starts (procs/failpoints.py); this process never does.
    points = f"writer.after_publish=1:{killed}" + (f",writer.before_publish={writers}:barrier:{met}" * (writers > 1))
    monkeypatch.setenv("GIGASHUFFLE_FAILPOINTS", points)
    cfg = DataloaderConfig(
        bs=8, shuffle_size=64, queue_name=f"owner-published-{uuid.uuid4().hex[:8]}", num_writers=writers,
        num_readers=1, max_restarts=2, redis_timeout_s=3.0, redis_url=redis_url,
    )  # fmt: skip
    with MultiprocessShuffledDataloader(ProcessIds(), cfg) as loader:
        batches = take(iter(loader), 20)
        assert killed.exists(), "the owner was not killed after its publication: the scenario did not happen"
        if writers > 1:
            assert len(list(met.iterdir())) == writers, "the writers did not both offer a buffer before publishing"
        assert loader.metrics().restarts >= 1, "the owner was not started again"
        # The trainer serves the published buffer from one fd of its own; an offer that lost the publication (two
        # writers may both allocate) is closed, not kept.
        assert _buffer_fds() == 1, f"the trainer holds {_buffer_fds()} fds of node buffers, not the one it serves"
    ids = [i for batch in batches for i in check_unique_batch(batch, 8, 64)]
    assert len(ids) == len(set(ids)), "a row came twice"


def _buffer_fds() -> int:
    """This process's fds of node buffer memfds."""
    return sum(target.startswith("/memfd:gigashuffle-buffer") for _fd, target in open_fds())
