"""Checkpoints ``load_state_dict()`` refuses in the training process, naming what differs, with nothing loaded (issue
22): another queue, truncated or tampered saved rows, another row layout, another world size or ``num_writers`` for
a dataset that cannot re-split its state, and an elastic resume without every rank's part (NOTE [ Elastic resume ])."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Counter, take
from elastic_job import write_shards

from gigashuffle import CheckpointError, DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.checkpoint.parts import own_part
from gigashuffle.procs import failpoints
from gigashuffle.sources import ParquetReader, Sharded, shardcursor

FAR = 10**6  # a position no test reads up to: a writer that got the refused state would show it


class NarrowCounter(Counter):
    """``Counter`` with an int32 ``counter``: another row layout."""

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        for chunk in super().__iter__():
            yield [{"id": chunk[0]["id"], "counter": chunk[0]["counter"].to(torch.int32)}]


def _config(redis_url: str, queue: str, **overrides: Any) -> DataloaderConfig:
    settings: dict[str, Any] = dict(bs=4, shuffle_size=64, queue_name=queue, num_writers=1, num_readers=1,
                                    redis_url=redis_url)  # fmt: skip
    return DataloaderConfig(**{**settings, **overrides})


def _checkpoint(redis_url: str, queue: str) -> dict[str, Any]:
    """A checkpoint with saved rows, its writer's position moved far ahead (FAR): loading it would show."""
    with MultiprocessShuffledDataloader(Counter(), _config(redis_url, queue)) as loader:
        take(iter(loader), 5)
        state = loader.state_dict()
    part = state["rank0"]
    assert part["rows"] and part["rows"]["count"] > 0, "the cut saved no rows: the checks below test nothing"
    part["writers"] = [{"pos": FAR}]
    return state


def _refused_then_reads_from_the_start(loader: MultiprocessShuffledDataloader, state: Any, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        loader.load_state_dict(state)
    counters = [int(c) for b in take(iter(loader), 10) for c in b[0]["counter"]]
    assert max(counters) < FAR, "a writer got the refused checkpoint's state"


def test_a_checkpoint_of_another_queue_is_refused(redis_url: str) -> None:
    queue = f"refuse-q-{uuid.uuid4().hex[:8]}"
    state = _checkpoint(redis_url, queue)
    with MultiprocessShuffledDataloader(Counter(), _config(redis_url, queue + "-other")) as loader:
        _refused_then_reads_from_the_start(
            loader, state, rf"of queue '{queue}' but this loader's queue is '{queue}-other'"
        )


def test_truncated_or_tampered_saved_rows_are_refused(redis_url: str) -> None:
    queue = f"refuse-rows-{uuid.uuid4().hex[:8]}"
    state = _checkpoint(redis_url, queue)
    rows = state["rank0"]["rows"]
    truncated = {"rank0": {**state["rank0"], "rows": {**rows, "fields": [f[:-1] for f in rows["fields"]]}}}
    tampered_fields = [f.clone() for f in rows["fields"]]
    tampered_fields[0][0, 0] ^= 1
    tampered = {"rank0": {**state["rank0"], "rows": {**rows, "fields": tampered_fields}}}
    with MultiprocessShuffledDataloader(Counter(), _config(redis_url, queue)) as loader:
        with pytest.raises(CheckpointError, match=rf"holds {rows['count'] - 1} rows but the checkpoint saved"):
            loader.load_state_dict(truncated)
        _refused_then_reads_from_the_start(loader, tampered, "does not match its checksum")


def test_saved_rows_of_another_row_layout_are_refused_naming_the_field(redis_url: str) -> None:
    queue = f"refuse-layout-{uuid.uuid4().hex[:8]}"
    state = _checkpoint(redis_url, queue)
    with MultiprocessShuffledDataloader(NarrowCounter(), _config(redis_url, queue)) as loader:
        match = r"chunk\[0\]\['counter'\]: checkpoint int64\[\], dataset int32\[\]"
        _refused_then_reads_from_the_start(loader, state, match)


def test_another_layout_for_a_dataset_that_cannot_reshard_is_refused(redis_url: str) -> None:
    queue = f"refuse-elastic-{uuid.uuid4().hex[:8]}"
    state = _checkpoint(redis_url, queue)
    with MultiprocessShuffledDataloader(Counter(), _config(redis_url, queue, num_writers=2)) as loader:
        match = (
            r"global_world_size=1, num_writers=1 and this loader has global_world_size=1, num_writers=2, and the "
            r"dataset Counter cannot re-split its state: it must offer reshard_states\(states, skips, "
        )
        _refused_then_reads_from_the_start(loader, state, match)


def test_an_elastic_resume_needs_every_ranks_part(tmp_path: Path) -> None:
    shards = write_shards(tmp_path / "shards", (5, 6, 7))
    dataset = Sharded(sorted(str(p) for p in shards.glob("*.parquet")), ParquetReader(), rows=2)
    cfg = DataloaderConfig(bs=4, shuffle_size=64, queue_name="parts", num_writers=1)
    one = {"queue": "parts", "global_world_size": 2, "num_writers": 1, "skip": [0], "rows": {}}
    rank0 = {**one, "global_rank": 0, "writers": [dataset.reshard_states([dataset.state_dict()], [0], 2)[0]]}
    with pytest.raises(
        CheckpointError, match=r"every old rank's part but \['rank1'\] are missing.*gathered_state_dict"
    ):
        own_part(cfg, {"rank0": rank0}, dataset)
    rank1 = {**one, "global_rank": 1, "writers": [dataset.reshard_states([dataset.state_dict()], [0], 2)[1]]}
    mine = own_part(cfg, {"rank0": rank0, "rank1": rank1}, dataset)
    every_piece = list(range(len(shardcursor.pieces([5, 6, 7]))))  # NOTE [ Balanced pieces ]
    assert [c[0] for c in mine["writers"][0]["cursor"]] == every_piece, "one writer gets every piece back"


def test_a_checkpoint_of_a_newer_format_is_refused_naming_both_formats(redis_url: str) -> None:
    """Every part carries ``"format"`` (docs/checkpoint-format.md); a part without it is format 0 and loads (the
    other tests here load such dicts); one of a format this version does not know is refused, not guessed at."""
    queue = f"refuse-format-{uuid.uuid4().hex[:8]}"
    state = _checkpoint(redis_url, queue)
    assert state["rank0"]["format"] == 1
    newer = {"rank0": {**state["rank0"], "format": 2}}
    with MultiprocessShuffledDataloader(Counter(), _config(redis_url, queue)) as loader:
        _refused_then_reads_from_the_start(loader, newer, r"rank0 is in checkpoint format 2 but this gigashuffle "
                                                          r"reads formats 0 to 1")  # fmt: skip
    part = own_part(_config(redis_url, queue), {"rank0": {k: v for k, v in state["rank0"].items() if k != "format"}})
    assert len(part["rows"]) == state["rank0"]["rows"]["count"], "a part without 'format' (format 0) loads"


def test_a_cut_that_cannot_map_the_slot_table_fails_instead_of_saving_no_buffer_row(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer maps the node's slot table to list the buffer's rows at a cut. If it cannot (no attach socket
    answers), the checkpoint fails with a CheckpointError, and is whole once the table can be mapped; it once saved
    no buffer row at all and said so only in a debug log. The fail point is armed in this (the trainer's) process
    only: its children attach as usual."""
    marker = tmp_path / "fired"
    monkeypatch.setattr(failpoints, "_POINTS", {"trainer.map_table": (1, f"error:{marker}")})
    monkeypatch.setattr(failpoints, "ACTIVE", True)
    queue = f"refuse-table-{uuid.uuid4().hex[:8]}"
    with MultiprocessShuffledDataloader(Counter(), _config(redis_url, queue)) as loader:
        take(iter(loader), 5)
        with pytest.raises(CheckpointError, match="cannot map the node's slot table"):
            loader.state_dict()
        assert marker.exists(), "the fail point never fired: the test checked nothing"
        monkeypatch.setattr(failpoints, "ACTIVE", False)
        part = loader.state_dict()["rank0"]
        take(iter(loader), 5)  # the failed cut resumed every child
    assert part["rows"] and part["rows"]["count"] >= 64 // 2, "the buffer's rows were not saved once it was mapped"


def test_a_writer_death_whose_commits_cannot_be_read_stops_the_loader_instead_of_repeating_rows(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a dead writer's committed rows end is read from the node's slot table (NOTE [ Lanes ]); a trainer that
    cannot map it once started the successor from its predecessor's start, with a warning, and so repeated every
    row that writer had committed. Now the loader fails with a CheckpointError that says why. The writer is killed
    by a fail point of its own (armed in the zygote's environment), the table is kept unmapped by one of the
    trainer's."""
    killed, unmapped = tmp_path / "killed", tmp_path / "unmapped"
    monkeypatch.setenv("GIGASHUFFLE_FAILPOINTS", f"writer.after_commit=6:{killed}")
    monkeypatch.setattr(failpoints, "_POINTS", {"trainer.map_table": (1, f"error:{unmapped}")})
    monkeypatch.setattr(failpoints, "ACTIVE", True)
    queue = f"refuse-death-{uuid.uuid4().hex[:8]}"
    config = _config(redis_url, queue, max_restarts=3)
    refused = pytest.raises(CheckpointError, match="writer 0 died and the node's slot table cannot be read")
    with MultiprocessShuffledDataloader(Counter(), config) as loader, refused:
        take(iter(loader), 10**6)  # ends with the error: rows stop when the only writer is not respawned
    assert killed.exists(), "the writer's fail point never fired: the test checked nothing"
    assert unmapped.exists(), "the trainer's fail point never fired: the test checked nothing"
