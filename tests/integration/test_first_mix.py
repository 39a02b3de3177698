"""Mixing from the first batch (NOTE [ First mix ] in procs/firstmix.py): the readers' first batches already hold
rows of every writer of the node, even when one writer's source starts late."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from datasets import (
    Chunk,
    FewShards,
    LateUniqueIds,
    UniqueIds,
    _worker,
    check_unique_batch,
    passes_by_worker,
    take,
    writer_of,
)

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.procs import firstmix
from gigashuffle.trainer import progress

# The first-mix promise covers the start: without it, the first 300-400 batches came from one writer. Later batches
# mix as the writers' relative rates allow, which scheduling decides: a writer descheduled for a second on a loaded
# 2-core machine lets the other one refill the buffer alone (after ~8,000 rows drawn without it, one batch of 64 in
# a hundred lacks it). Within the first 50 batches (3,200 rows of a 4,096-slot buffer) at least a quarter of the
# rows stay from each writer even if one stops at once after the threshold, so a batch lacking one is a ~1e-7 event.
BS, SHUFFLE, BATCHES = 64, 4096, 50


@pytest.mark.parametrize("late_s", [0.0, 2.0], ids=["both-fast", "one-late"])
def test_the_first_batches_mix_every_writer(redis_url: str, late_s: float) -> None:
    cfg = DataloaderConfig(
        bs=BS, shuffle_size=SHUFFLE, queue_name=f"mix-{uuid.uuid4().hex[:8]}", num_writers=2, num_readers=2,
        redis_url=redis_url,
    )  # fmt: skip
    with MultiprocessShuffledDataloader(LateUniqueIds(chunk=64, late=(1,), late_s=late_s), cfg) as loader:
        writers = []
        for batch in take(iter(loader), BATCHES):
            ids = check_unique_batch(batch, BS, SHUFFLE)
            writers.append(sorted({int(writer_of(i)) for i in ids}))
    single = [(n, w) for n, w in enumerate(writers) if w != [0, 1]]
    assert not single, f"{len(single)} of the first {BATCHES} batches lack a writer (batch, writers): {single[:10]}"


class UnevenlySlowIds(UniqueIds):
    """``UniqueIds`` of 4-row chunks, each writer sleeping ``sleep_s[id]`` per chunk: every writer writes, some
    slowly (a healthy slow start)."""

    def __init__(self, sleep_s: tuple[float, ...]) -> None:
        super().__init__(chunk=4)
        self.sleep_s = sleep_s

    def __iter__(self) -> Iterator[Chunk]:
        pause = self.sleep_s[_worker()[0]]
        for chunk in super().__iter__():
            time.sleep(pause)  # the source's speed, not a synchronisation
            yield chunk


def test_a_slow_start_with_every_writer_writing_logs_progress_and_no_warning(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 35, item 4: the buffer takes longer than first_mix_wait_s, and longer than the STALL_S without a row
    that makes a writer stalled, to reach the first batch's rows, both writers writing all along (writer 1 at half
    writer 0's rate: writer 0's share is in first, and it waits first_mix_wait_s for writer 1's, which never comes
    before the first batch). No WARNING from the trainer (caplog: its check of late writers runs the whole wait) or
    the writers (their stderr, at the levels caplog set: NOTE [ Child logs ]), and the rows in / rows needed at INFO."""
    monkeypatch.setattr(progress, "FIRST_LINE_S", 0.2)
    caplog.set_level(logging.INFO, logger="gigashuffle")
    cfg = DataloaderConfig(
        bs=8, shuffle_size=512, queue_name=f"slow-start-{uuid.uuid4().hex[:8]}", num_writers=2, num_readers=1,
        first_mix_wait_s=1.0, redis_url=redis_url,
    )  # fmt: skip
    # 256 rows for the first batch, 128 per writer: 4 rows every 0.3 s and every 0.6 s, 20 rows/s together, so
    # writer 0's share is in after ~9.6 s, writer 1 has ~64 rows then, and the first batch comes after ~13 s: past
    # STALL_S, when a trainer that warned of every late writer, progressing or not, warned of writer 1.
    with MultiprocessShuffledDataloader(UnevenlySlowIds((0.3, 0.6)), cfg) as loader:
        # The trainer's clock of rows written starts at its first wait, so the zygote's start-up (seconds on a loaded
        # machine) is kept out of it: a writer not started yet has written no row, and warning of that is right.
        loader.wait_started()
        started = time.monotonic()
        check_unique_batch(take(iter(loader), 1)[0], 8, 512)
        waited = time.monotonic() - started
    assert waited > firstmix.STALL_S, f"the first batch came after {waited:.1f} s: not a slow start"
    warnings = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warnings, warnings
    err = capfd.readouterr().err
    assert "first mix" not in err and "fills on without them" not in err and "late" not in err, err
    lines = [r.getMessage() for r in caplog.records if r.name == "gigashuffle.trainer.progress"]
    assert any("filling the shuffle buffer" in line and "/256 rows" in line for line in lines), lines


def test_writers_with_empty_shares_do_not_hold_the_first_batch_back(redis_url: str, tmp_path: Path) -> None:
    """Issue 35, item 4: 3 writers, a source of 1 shard split by worker (as Hugging Face's): writers 1 and 2 idle on
    empty shares, say so node-wide, and writer 0's share grows to the whole first mix, so the first batch comes
    well before first_mix_wait_s=200 (NOTE [ First mix ])."""
    cfg = DataloaderConfig(
        bs=4, shuffle_size=64, queue_name=f"empty-mix-{uuid.uuid4().hex[:8]}", num_writers=3, num_readers=1,
        writer_max_retries=3, first_mix_wait_s=200.0, redis_url=redis_url,
    )  # fmt: skip
    with MultiprocessShuffledDataloader(FewShards(shards=1, passes_file=str(tmp_path / "passes")), cfg) as loader:
        loader.wait_started()  # the zygote's start-up is no part of what is timed
        started = time.monotonic()
        batch = take(iter(loader), 1)[0]
        waited = time.monotonic() - started
        # Held back, the batch would wait first_mix_wait_s: a bound far from both (a batch comes in a second or two).
        assert waited < 100.0, f"the first batch took {waited:.1f} s: the empty shares held writer 0's back"
        assert {int(w) for w in writer_of(batch[0]["id"])} == {0}
        assert set(passes_by_worker(str(tmp_path / "passes"))) == {0, 1, 2}
