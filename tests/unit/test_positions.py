"""A writer's row numbering, kept states and filter (procs/positions.py; NOTE [ Positions checkpoint ] in
checkpoint/positions.py), and the trainer's numbering of a respawned writer's stream (checkpoint/respawn.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gigashuffle.checkpoint import positions, rereads
from gigashuffle.checkpoint.respawn import ResumePoints
from gigashuffle.config import DataloaderConfig
from gigashuffle.errors import CheckpointError
from gigashuffle.procs import positions as positions_of_writer
from gigashuffle.procs.messages import DatasetState, Progress
from gigashuffle.procs.positions import LANE_SHIFT, NO_ORIGIN, Track
from gigashuffle.procs.resume import COUNTER_BYTES
from gigashuffle.resumepoint import ResumePoint
from gigashuffle.shm.buffer import SharedMemory


def test_a_bad_checkpoint_rows_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="checkpoint_rows='rows' is invalid: use 'saved'"):
        DataloaderConfig(bs=4, shuffle_size=64, queue_name="q", checkpoint_rows="rows")


def test_origins_are_lane_and_stream_row_and_saved_rows_have_none() -> None:
    track = Track(True, lane=3, keep_rows=100)
    track.restart(1000, {"pos": 0}, np.empty(0, np.int64), 0, 0)
    assert track.select(produced=10, rows=4, skipped=0) is None
    origin = np.full(8, 7, dtype=np.int64)
    track.stamp(origin, np.array([5, 2]), done=1, saved=False)
    assert (origin[[5, 2]] >> LANE_SHIFT).tolist() == [3, 3]
    assert (origin[[5, 2]] & ((1 << LANE_SHIFT) - 1)).tolist() == [1011, 1012]
    track.stamp(origin, np.array([0]), done=0, saved=True)
    assert origin[0] == NO_ORIGIN


def test_kept_states_reach_back_keep_rows_and_no_further() -> None:
    track = Track(True, lane=0, keep_rows=64)
    track.restart(0, {"pos": 0}, np.empty(0, np.int64), 0, 0)
    for produced in range(0, 320, 16):
        track.before_chunk(produced, {"pos": produced})
    starts = [row for row, _ in track.retained]
    assert starts[0] <= 304 - 64 < starts[1] and starts[-1] == 304


def test_a_filter_writes_kept_rows_and_everything_from_until_on() -> None:
    track = Track(False, lane=0, keep_rows=64)
    skip = track.restart(100, {"pos": 100}, np.array([101, 104, 107]), 106, 2)
    assert skip == 0  # folded: rows 100, 101 are skipped whatever keep says
    chosen = track.select(produced=0, rows=10, skipped=0)
    assert chosen is not None and chosen.tolist() == [4, 6, 7, 8, 9]
    assert track.select(produced=10, rows=4, skipped=0) is None  # past until: every row


def test_with_a_filter_the_head_and_a_dead_writers_commits_map_back_to_stream_rows() -> None:
    track = Track(True, lane=0, keep_rows=64)
    track.restart(0, {}, np.array([1, 5]), 8, 0)
    chosen = track.select(produced=0, rows=10, skipped=0)  # rows 1, 5, 8, 9
    assert chosen is not None and chosen.tolist() == [1, 5, 8, 9]
    assert track.head(at=0, skip=0, done=2) == 6
    # the lane counts rows written: 2 of them end at stream row 6 (a successor's filter drops 6 and 7), 4 at 10
    assert [positions_of_writer.filtered_commits(0, [1, 5], 8, 0, n)[0] for n in (0, 2, 4)] == [0, 6, 10]
    # a skip is folded in as the writer folds it: rows 100, 101 skipped; 104, then 106 on are written
    offset, keep, until = positions_of_writer.filtered_commits(100, [101, 104, 107], 106, 2, 3)
    assert (offset, keep.tolist(), until) == (8, [104, 107], 106)
    assert positions_of_writer.filtered_commits(100, [], 0, 2, 7)[0] == 7  # no filter: the lane's count stands


def test_a_respawned_writer_goes_on_with_its_stream_numbering_and_filter() -> None:
    points = ResumePoints(1)
    keep = np.array([503], dtype=np.int64)
    serial = points.load([ResumePoint(state={"pos": 0}, base=500, keep=keep, until=520)])[0].serial
    counter = SharedMemory(COUNTER_BYTES, name="test-commits")
    np.frombuffer(counter.numpy_view(0, COUNTER_BYTES), np.int64)[:] = (serial, 0, 0)
    points.on_attached(0, [os.dup(counter.fd)])  # the points take the fd over, as from Attached
    points.on_report(0, Progress(serial, 32, {"pos": 32}))
    points.on_death(0, (0, 1), lambda lanes: (40, 0))  # 40 rows written: 503, then 520..558
    point = points.start_of(0)
    assert (point.state, point.skip, point.base, point.keep.tolist(), point.until) == (
        {"pos": 32}, 59 - 32, 532, [503], 520
    )  # fmt: skip
    assert point.serial != serial, "a successor counts under a new serial"
    counter.close()
    points.close()


def test_an_elastic_resume_folds_an_empty_keep_into_the_skip_and_refuses_a_damaged_entry() -> None:
    """Rows to re-read become saved rows (tests/unit/test_rereads.py); with none, ``until`` is a plain skip."""
    empty = {"at": 10, "keep": torch.empty(0, dtype=torch.int64), "until": 7}
    part = {"skip": [0, 2], "positions": [empty, None], "writers": [{"pos": 10}, {"pos": 3}]}
    assert rereads.fold(None, "rank0", part) == ([7, 2], [])
    with pytest.raises(CheckpointError, match="damaged"):
        positions.checked("rank0", [{"at": 0, "keep": torch.tensor([5, 3]), "until": 9}], 1)


def test_rows_found_past_a_respawned_writers_head_stay_in_the_checkpoint() -> None:
    """A successor that has not written yet answers its start as its head; its predecessor's committed rows after
    that (skipped by its filter) are still in the buffer and must be kept (a trim at the head lost them)."""
    info = {"at": 80, "head": 80, "retained": [(80, {"pos": 80})], "keep": np.array([230]), "until": 288,
            "found": [np.array([100, 90])]}  # fmt: skip
    state, entry = positions.entry_of(DatasetState(1, 0, {"pos": 80}, 0, positions=info))
    assert entry is not None
    assert (state, entry["at"], entry["keep"].tolist(), entry["until"]) == ({"pos": 80}, 80, [10, 20, 150], 208)


def test_the_cut_counts_its_own_lanes_rows_and_saves_the_rest_it_answers_for() -> None:
    """Two ranks of one writer: a rank re-reads its lane's rows from its oldest kept state on and saves its older
    ones; the other rank's lane is not its business; rows of no origin or a foreign lane are local rank 0's."""
    origin = np.array([(1 << LANE_SHIFT) | 12, (1 << LANE_SHIFT) | 5, 7, -1, (5 << LANE_SHIFT) | 1], dtype=np.int64)
    for rank, oldest_row, saved, again in ((1, 10, [1], [12]), (0, 0, [3, 4], [7])):
        saves = np.zeros(4, dtype=bool)  # index lane + 1; 0: no origin; 3: lanes past the node's two
        saves[rank + 1] = True
        saves[0] = saves[-1] = rank == 0
        found: dict[int, list[np.ndarray]] = {rank: []}
        got = positions._covered(origin.copy(), {rank: oldest_row}, found, saves)
        assert np.flatnonzero(got).tolist() == saved
        assert np.concatenate(found[rank]).tolist() == again
