"""The buffer's owner dies before any other child of the node attached (NOTE [ The trainer holds the buffer ] in
trainer/nodetable.py): the trainer got the buffer's memfds with the owner's ``Attached`` and serves them, so the
respawned writer and a reader that attaches late still find the buffer. Before, nobody served it: both waited
``redis_timeout_s`` and died with ``AttachError``, and the loader failed."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from datasets import ProcessIds, check_unique_batch, take

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader


def test_a_buffer_whose_owner_died_before_any_other_child_attached_is_still_served(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed, slowed = tmp_path / "owner-killed", tmp_path / "reader-slowed"
    # The owner (the one writer) is SIGKILLed after its first commit; the reader sleeps 4 s before it attaches, long
    # after that. The zygote reads the fail points when it starts (procs/failpoints.py); this process never does.
    monkeypatch.setenv(
        "GIGASHUFFLE_FAILPOINTS", f"writer.after_commit=1:{killed},reader.before_attach=1:sleep=4:{slowed}"
    )
    cfg = DataloaderConfig(
        bs=8, shuffle_size=64, queue_name=f"owner-death-{uuid.uuid4().hex[:8]}", num_writers=1, num_readers=1,
        max_restarts=2, redis_timeout_s=3.0, redis_url=redis_url,
    )  # fmt: skip
    with MultiprocessShuffledDataloader(ProcessIds(), cfg) as loader:
        batches = take(iter(loader), 20)
        assert killed.exists(), "the owner was not killed: the scenario did not happen"
        assert slowed.exists(), "the reader's attach was not delayed: the scenario did not happen"
        assert loader.metrics().restarts >= 1, "the owner was not started again"
    ids = [i for batch in batches for i in check_unique_batch(batch, 8, 64)]
    assert len(ids) == len(set(ids)), "a row came twice"
