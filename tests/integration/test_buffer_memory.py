"""A node buffer larger than the memory the node can give is refused when it is made, in the training process, with
an error that names ``shuffle_size`` and what fits (NOTE [ A buffer the node cannot hold ] in host/memory.py);
without the check it was made (a sparse memfd) and failed only once nearly full, as an OOM kill."""

from __future__ import annotations

import logging
import re
import uuid

import pytest
from datasets import WideRows, take

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader, WorkerDied
from gigashuffle.host.memory import WARN_SHARE, available

ROW_BYTES = 1 << 20


def _config(redis_url: str, shuffle_size: int) -> DataloaderConfig:
    return DataloaderConfig(
        bs=2, shuffle_size=shuffle_size, queue_name=f"mem-{uuid.uuid4().hex[:8]}", num_writers=1, num_readers=1,
        redis_url=redis_url, min_mixing=0.0,
    )  # fmt: skip


def _room() -> int:
    found = available()
    # Without a figure the writer would make the buffer and fill this machine: stop before any loader starts.
    assert found is not None, "no memory figure on this host (/proc/meminfo): the check would not run"
    return found[0]


def test_a_buffer_larger_than_the_available_memory_is_refused_naming_shuffle_size(redis_url: str) -> None:
    slots = 2 * _room() // ROW_BYTES + 64  # twice what the node can hold, in 1 MiB rows
    loader = MultiprocessShuffledDataloader(WideRows(ROW_BYTES), _config(redis_url, slots))
    with loader, pytest.raises(WorkerDied) as caught:
        take(iter(loader), 1)
    message = str(caught.value)
    assert "ValueError" in message, message
    assert f"DataloaderConfig.shuffle_size={slots} is too large for this node" in message, message
    fits = re.search(r"Use shuffle_size <= (\d+)", message)
    assert fits is not None, message
    assert slots // 3 <= int(fits.group(1)) <= slots // 2 + 1, message  # about half of it fits now


def test_a_buffer_near_the_available_memory_is_made_with_a_warning(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The check itself, as the writer runs it, on this host's figure: no 20 GiB buffer is made to show the warning.
    from gigashuffle.host.memory import refuse_a_buffer_too_large

    room = _room()
    with caplog.at_level(logging.WARNING, logger="gigashuffle.host.memory"):
        refuse_a_buffer_too_large(int(room * (WARN_SHARE + 1) / 2), 1000, ROW_BYTES, "q")
    assert any("takes" in r.getMessage() and "of the memory available now" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gigashuffle.host.memory"):
        refuse_a_buffer_too_large(room // 10, 1000, ROW_BYTES, "q")
    assert not caplog.records
