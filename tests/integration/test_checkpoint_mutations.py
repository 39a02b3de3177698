"""Real-process tests for the checkpoint mutations no other real-process test caught (issue 32, item 7): each holds
open the window its mutation needs and asserts, with the window's markers, that it was held.

* Skip the ``PAUSED`` barrier, rows way (checkpoint/cut.py): local rank 0 lists the node's buffer while the other
  rank still delivers. The other rank's readers draw listed slots; if its writer refills them before rank 0's
  copy, the copy saves the new rows and the mistake hides (test_checkpoint_nodecut.py's reader saw 0 of 2). Here
  the other rank's writer is held (tests/integration/checkpoint_job.py ``HeldIds``) from the moment rank 0 is in
  its cut until its own cut has asked it for its state, and the other rank reads only once rank 0 has arrived at
  a node barrier (its entry in the cut hash; the mutated rank 0 has listed by then): what it draws is listed and
  never overwritten, so a cut that did not wait saves it twice.
* A writer answering from its chunk's start in the first-mix wait, positions way (procs/writecycle.py): harmless
  without a filter (test_checkpoint_after_resume.py), but after a resume whose filter reaches into that chunk the
  rows found in the buffer repeat the filter's ``keep`` and the checkpoint cannot be loaded. Here writer 0 resumes
  with a filter that keeps every row of its pass, and the cut comes while it waits inside a chunk.
"""

from __future__ import annotations

import collections
import uuid
from pathlib import Path

import pytest
import torch
from test_checkpoint_after_resume import BS, CHUNK, IDS, SHUFFLE, _start, checkpointed_in_the_window
from test_checkpoint_nodecut import STRIDE, _counted, _segment

from gigashuffle import DataloaderConfig

_NODE_IDS = "200"  # ids per writer per pass in the two-rank scenario (nodecut_job.py --ids)


def test_a_rank_that_draws_while_local_rank_0_is_at_a_barrier_of_its_cut_has_nothing_saved_twice(
    redis_url: str, tmp_path: Path
) -> None:
    """Two ranks of one node, rows way. Rank 1 reads nothing once rank 0 is in its cut, its writer held from then
    on; once rank 0 has arrived at a node barrier it reads 6 batches (counted), its reader drawing from the buffer
    with no writer of the node writing, then takes the checkpoint. A resume must bring back every id not counted
    once. Its ring holds 2 batches, so at least 3 of the 6 were drawn once rank 0 was at the barrier (24 rows; a
    low ``min_mixing`` leaves rows to draw), and its writer overwrites at most 16 slots before its cut holds it
    (the rest of the chunk it was in, one chunk once asked): without the PAUSED wait, at least 8 ids twice."""
    started, asked = tmp_path / "rank0-in-cut", tmp_path / "rank1-asked"
    held, saw = tmp_path / "rank1-writer-held", tmp_path / "rank1-saw-rank0-at-barrier"
    queue, ckpt = f"mut-paused-{uuid.uuid4().hex[:8]}", tmp_path / "ckpt.pt"
    common = ["--ids", _NODE_IDS, "--min-mixing", "0.1", "--ring-depth", "2", "--way", "saved"]
    rank1 = ["--hold-writer", f"{started}:{asked}:{held}", "--cut-started", str(started), "--after-cut-entry", "6",
             "--saw-cut-entry", str(saw)]  # fmt: skip
    points = {0: f"cut.readers_asked=1:sleep=0.001:{started}", 1: f"cut.readers_asked=1:sleep=0.001:{asked}"}
    first = tmp_path / "seg0"
    log = _segment(redis_url, queue, first, 2, 2, *common, "--before", "8", "--after", "2", "--save", str(ckpt),
                   per_rank={1: rank1}, failpoints=points)  # fmt: skip
    assert ckpt.exists(), f"no checkpoint:\n{log}"
    # The window: rank 0 in its cut and at a barrier, rank 1's writer held until its own cut asked it.
    for marker in (started, saw, held, asked):
        assert marker.exists(), f"{marker.name} missing: the window was not held\n{log}"
    assert not Path(f"{held}.deadline").exists(), f"rank 1's writer was let go by its deadline, not its cut\n{log}"
    counted = _counted(first, 2)
    (tmp_path / "counted").write_text(" ".join(str(i) for i, ps in counted if ps == 0))
    last = tmp_path / "last"
    log = _segment(redis_url, queue, last, 2, 2, *common, "--resume", str(ckpt), "--before", "0", "--counted",
                   str(tmp_path / "counted"), "--drain-past", str(4 * 128))  # fmt: skip
    assert "Traceback" not in log, log
    counted += _counted(last, 2)
    seen = collections.Counter(i for i, ps in counted if ps == 0)
    everything = {w * STRIDE + i for w in range(2) for i in range(int(_NODE_IDS))}
    assert set(seen) <= everything
    lost, twice = len(everything - set(seen)), sorted(i for i, n in seen.items() if n > 1)
    assert (lost, len(twice)) == (0, 0), f"{lost} ids lost, {len(twice)} twice, e.g. {twice[:8]}"


def test_a_positions_checkpoint_in_the_first_mix_wait_after_a_positions_resume_loads_and_counts_each_row_once(
    redis_url: str,
) -> None:
    """test_checkpoint_after_resume.py's scenario by positions, resumed from a checkpoint whose writer 0 keeps
    every row of its pass (a filter up to ``IDS``): the cut comes while writer 0 waits inside its second chunk."""
    queue = f"mut-chunk-start-{uuid.uuid4().hex[:8]}"
    cfg = DataloaderConfig(bs=BS, shuffle_size=SHUFFLE, queue_name=queue, num_writers=2, num_readers=1,
                           redis_url=redis_url, checkpoint_rows="positions")  # fmt: skip
    share = cfg.min_full_slots // 2
    if share % CHUNK == 0:
        raise AssertionError("the share must end inside a chunk for this test to mean anything")
    start = _start(queue)
    keep_all = {"at": 0, "keep": torch.arange(IDS, dtype=torch.int64), "until": IDS}
    start["rank0"]["positions"] = [keep_all, None]
    seen = checkpointed_in_the_window(cfg, start)
    twice = sorted(i for i, n in seen.items() if n > 1)
    assert not twice, f"{len(twice)} rows of pass 0 came twice after the resume, e.g. {twice[:10]}"


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
