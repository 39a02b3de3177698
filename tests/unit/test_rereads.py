"""Reading a positions checkpoint's kept rows for an elastic resume (NOTE [ Positions across layouts ] in
checkpoint/rereads.py). The whole path, with real loaders over parquet shards, is in
tests/integration/test_checkpoint_elastic.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from gigashuffle.checkpoint import rereads
from gigashuffle.errors import CheckpointError
from gigashuffle.rowblock import RowBlock


class Counting:
    """Chunks of 4 consecutive ids from ``start``; ``passes`` passes of ``rows`` rows, one per ``iter()``."""

    def __init__(self, rows: int, passes: int = 1) -> None:
        self.rows, self.passes, self.at = rows, passes, 0

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        end = (self.at // self.rows + 1) * self.rows
        if self.at >= self.rows * self.passes:
            return
        while self.at < end:
            n = min(4, end - self.at)
            ids = torch.arange(self.at, self.at + n, dtype=torch.int64)
            self.at += n
            yield [{"id": ids}]


def ids_of(rows: RowBlock) -> list[int]:
    return rows.fields[0].contiguous().view(torch.int64).flatten().tolist()


def part(state: dict[str, int], keep: list[int], until: int, skip: int = 0) -> dict[str, Any]:
    entry = {"at": state["at"], "keep": torch.tensor(keep, dtype=torch.int64), "until": until}
    return {"writers": [state], "skip": [skip], "positions": [entry], "rows": RowBlock()}


def test_the_kept_rows_are_read_from_the_state_across_a_pass_and_the_rest_is_a_skip() -> None:
    dataset = Counting(rows=10, passes=2)
    skips, kept = rereads.fold(dataset, "rank0", part({"at": 7}, keep=[0, 2, 5, 9], until=11, skip=1))
    assert skips == [11]  # max(until, skip): the writer writes every row from there on
    assert [k.count for k in kept] == [3]  # offset 0 is within the skip
    assert ids_of(kept[0].read()) == [9, 12, 16]  # stream rows 7 + offsets, the last two in the second pass
    assert dataset.at == 0, "the loader's own dataset is not moved"


def test_a_stream_that_ends_before_a_kept_row_is_refused_naming_the_writer() -> None:
    _skips, kept = rereads.fold(Counting(rows=10), "rank1", part({"at": 6}, keep=[1, 8], until=9))
    with pytest.raises(CheckpointError, match="rank1's writer 0 must re-read rows up to 8"):
        kept[0].read()


def test_each_rank_reads_only_the_kept_rows_of_its_share() -> None:
    reads: list[int] = []

    def kept(first: int, n: int) -> rereads.Kept:
        def read() -> RowBlock:
            reads.append(first)
            ids = torch.arange(first, first + n, dtype=torch.int64)
            return RowBlock("L", (ids.view(torch.uint8).reshape(n, 8),))

        return rereads.Kept(n, read)

    saved = RowBlock("L", (torch.arange(100, 104, dtype=torch.int64).view(torch.uint8).reshape(4, 8),))
    segments: list[RowBlock | rereads.Kept] = [saved, kept(0, 4), RowBlock(), kept(10, 4)]
    shares = [rereads.share(segments, rank, 3) for rank in range(3)]
    got = [[i for rows in pieces for i in ids_of(rows)] for pieces in shares]
    assert got == [[100, 101, 102, 103], [0, 1, 2, 3], [10, 11, 12, 13]]
    assert reads == [0, 10], "rank 0's share holds no kept rows: it reads none"
    assert np.array_equal(np.concatenate(got), [100, 101, 102, 103, 0, 1, 2, 3, 10, 11, 12, 13])


class ByWorker(Counting):
    """``Counting`` whose ids carry ``get_worker_info().id`` (a source that shards by worker, as Hugging Face's and
    webdataset's do): ids ``1000 * worker + row``."""

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else -1
        for chunk in super().__iter__():
            yield [{"id": chunk[0]["id"] + 1000 * worker}]


def test_each_old_writers_rows_are_read_as_that_writer_and_the_trainer_is_left_as_it_was() -> None:
    """The writer of rank 3 of an old job of 4 ranks x 1 writer was worker 3 of 4: its rows are read seeing that
    (read as no worker, a source that shards by worker gives other rows: -1000 + row here)."""
    _skips, kept = rereads.fold(ByWorker(rows=10), "rank3", part({"at": 2}, keep=[0, 3], until=5), 3, 4)
    assert ids_of(kept[0].read()) == [3002, 3005]
    assert torch.utils.data.get_worker_info() is None, "the training process still looks like a worker"
