"""Filling progress of a real loader on a slow dataset: lines on ``gigashuffle.trainer.progress`` while the buffer
fills to ``min_mixing``, and none once batches flow. Content is checked, not timing."""

from __future__ import annotations

import logging
import re
import uuid

import pytest
from datasets import SlowUniqueIds, check_unique_batch, take

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.trainer import progress

LINE = re.compile(
    r"^queue '(?P<queue>[^']+)' rank 0: filling the shuffle buffer: (?P<rows>[\d,]+)/(?P<total>[\d,]+) rows "
    r"\([\d.]+%\), (?P<rate>[\d,]+) rows/s, ETA (?P<eta>.+)$"
)


def test_a_slow_fill_logs_rows_rate_and_eta(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.2)
    caplog.set_level(logging.INFO, logger="gigashuffle.trainer.progress")
    queue = f"progress-{uuid.uuid4().hex[:8]}"
    # 2 writers of 4 rows every 50 ms: at least 1.6 s to reach 256 full rows, many intervals of 0.2 s.
    cfg = DataloaderConfig(
        bs=8, shuffle_size=512, min_mixing=0.5, queue_name=queue, num_writers=2, num_readers=1, redis_url=redis_url
    )
    with MultiprocessShuffledDataloader(SlowUniqueIds(chunk=4, sleep_s=0.05), cfg) as loader:
        check_unique_batch(take(iter(loader), 1)[0], 8, 512)
        lines = [r.getMessage() for r in caplog.records if r.name == "gigashuffle.trainer.progress"]
        progress_lines = [m for line in lines if (m := LINE.match(line))]
        assert progress_lines, f"no progress line while the buffer filled: {lines}"
        for match in progress_lines:
            assert match["queue"] == queue and match["total"] == "256"
            assert 0 <= int(match["rows"].replace(",", "")) <= 256
            assert match["eta"] == "unknown (no rows yet)" or re.fullmatch(r"< 1 s|\d+ s|\d+ min \d+ s", match["eta"])
        assert any(int(m["rate"].replace(",", "")) > 0 for m in progress_lines), "rows/s from the rows written"
        assert "reached 256 full rows (min_mixing)" in lines[-1], lines
        count = len(lines)
        take(iter(loader), 5)
        assert len([r for r in caplog.records if r.name == "gigashuffle.trainer.progress"]) == count, (
            "only while filling"
        )
