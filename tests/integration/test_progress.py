"""Filling progress of a real loader on a slow dataset: lines on ``gigashuffle.trainer.progress`` while the buffer
fills to ``min_mixing``, and none once batches flow. Content is checked, not timing."""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path

import pytest
from datasets import GatedUniqueIds, SlowUniqueIds, check_unique_batch, take

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.trainer import batches, progress

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


class _OpenTheGateOnAWarning(logging.Handler):
    """Lets the source's first chunk through once the trainer warned of its long wait (the warning is the event)."""

    def __init__(self, gate: Path) -> None:
        super().__init__(logging.WARNING)
        self.gate = gate
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(record.getMessage())
        self.gate.write_text("1000")


def test_a_long_wait_before_any_chunk_says_no_buffer_is_made_yet(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before any writer's first chunk there is no buffer: the long wait's warning says so and names the node,
    instead of printing a buffer of zero slots."""
    monkeypatch.setattr(batches, "_SLOW_WARNING_S", 0.5)
    gate = tmp_path / "allowed"
    warned = _OpenTheGateOnAWarning(gate)
    cfg = DataloaderConfig(bs=4, shuffle_size=64, queue_name=f"nobuffer-{uuid.uuid4().hex[:8]}", num_writers=1,
                           num_readers=1, redis_url=redis_url)  # fmt: skip
    logging.getLogger("gigashuffle.trainer.batches").addHandler(warned)
    try:
        with MultiprocessShuffledDataloader(GatedUniqueIds(str(gate)), cfg) as loader:
            check_unique_batch(take(iter(loader), 1)[0], 4, 64)
    finally:
        logging.getLogger("gigashuffle.trainer.batches").removeHandler(warned)
    assert warned.texts, "no warning of the long wait"
    assert "no buffer yet: no writer of node 'n0' has produced its first chunk" in warned.texts[0], warned.texts
