"""A checkpoint taken right after a resume, before the node's first read: every row comes back exactly once.

After ``load_state_dict`` each writer copies only its share of the node's first mix and then waits for the first
read (NOTE [ First mix ] in procs/firstmix.py). A writer whose share ends inside a chunk waits there; a
``state_dict()`` then must count the rows of that chunk it copied as in the buffer. Answered from the chunk's start
(as it once was), the resume wrote them again (saved rows). By positions without a filter that answer does no harm
(the rows past the answered head are found and read once more from ``until``); with a filter it made the checkpoint
one that load_state_dict refuses as damaged: test_checkpoint_mutations.py has that case.

Writer 1 sleeps before its first chunk after the resume, so writer 0's share is in (and the readers cannot start)
for as long: the cut comes inside that window, which the test checks rather than assumes.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

import pytest
from datasets import ID_STRIDE, PassIds
from timing import startup_deadline

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader

IDS, CHUNK, BS, SHUFFLE = 160, 40, 16, 256
# Writer 1's pause before its first chunk after the resume: the window the cut must fall in. Writer 0 must write its
# share within it, which a loaded machine can stall for seconds: it grows with the measured start-up (3 s idle).
LATE_S = startup_deadline(3.0, 2)
DRAIN_PAST = 256  # rows read after the last id of pass 0 came: a repeat would show among them


def _start(queue: str) -> dict[str, Any]:
    """The checkpoint of a job that read nothing yet, writer 1 made late (the dataset's own state)."""
    late = [0.0, LATE_S]
    return {
        "rank0": {
            "queue": queue, "global_rank": 0, "global_world_size": 1, "num_writers": 2,
            "writers": [{"pass": 0, "pos": 0, "late_s": s} for s in late], "skip": [0, 0], "rows": {},
        }
    }  # fmt: skip


def _pass0_ids(loader: MultiprocessShuffledDataloader, deadline_s: float) -> Counter[int]:
    """Every id of pass 0 read until each came once and ``DRAIN_PAST`` rows more, with its count."""
    seen: Counter[int] = Counter()
    wanted = {w * ID_STRIDE + i for w in range(2) for i in range(IDS)}
    deadline = time.monotonic() + deadline_s
    past = 0
    for batch in loader:
        group = batch[0]
        for row_id, row_pass in zip(group["id"].tolist(), group["pass"].tolist(), strict=True):
            if row_pass == 0:
                seen[row_id] += 1
            if wanted <= seen.keys():
                past += 1
        if past >= DRAIN_PAST:
            return seen
        if time.monotonic() > deadline:
            missing = sorted(wanted - seen.keys())
            raise AssertionError(f"{len(missing)} ids of pass 0 never came within {deadline_s:.0f} s: {missing[:10]}")
    raise AssertionError("the loader ended")


@pytest.mark.parametrize("way", ["saved", "positions"])
def test_a_checkpoint_before_the_first_read_after_a_resume_counts_each_row_once(redis_url: str, way: str) -> None:
    queue = f"after-resume-{uuid.uuid4().hex[:8]}"
    cfg = DataloaderConfig(bs=BS, shuffle_size=SHUFFLE, queue_name=queue, num_writers=2, num_readers=1,
                           redis_url=redis_url, checkpoint_rows=way)  # fmt: skip
    share = cfg.min_full_slots // 2  # writer 0's share of the first mix: 64 rows, inside its second chunk
    if share % CHUNK == 0:
        raise AssertionError("the share must end inside a chunk for this test to mean anything")
    seen = checkpointed_in_the_window(cfg, _start(queue))
    twice = sorted(i for i, n in seen.items() if n > 1)
    assert not twice, f"{way}: {len(twice)} rows of pass 0 came twice after the resume, e.g. {twice[:10]}"


def checkpointed_in_the_window(cfg: DataloaderConfig, start: dict[str, Any]) -> Counter[int]:
    """Resume ``start``, checkpoint while only writer 0's first-mix share is in (checked, not assumed), resume that
    checkpoint: the ids of pass 0 read after it, with their counts."""
    share = cfg.min_full_slots // 2
    deadline_s = startup_deadline(60.0, 20)
    with MultiprocessShuffledDataloader(PassIds(IDS, CHUNK), cfg) as resumed:
        resumed.load_state_dict(start)
        deadline = time.monotonic() + deadline_s
        while (full := resumed.stats().full) < share:
            if time.monotonic() > deadline:
                raise AssertionError(f"writer 0 did not write its share ({share} rows) within {deadline_s:.0f} s")
            time.sleep(0.01)
        # The window: only writer 0's share is in, so it waits inside its second chunk for the first read.
        assert full == share, f"{full} rows full, not writer 0's {share} alone: writer 1 was not late enough"
        checkpoint = resumed.state_dict()
    with MultiprocessShuffledDataloader(PassIds(IDS, CHUNK), cfg) as last:
        last.load_state_dict(checkpoint)
        return _pass0_ids(last, deadline_s)
