"""Checkpoint behaviour a user hits without a crash (issue 22): restore before reading, a checkpoint while a writer
is dead, ``sources.Chunked`` forwarding its source's state, and the checks on a checkpoint's own part."""

from __future__ import annotations

import collections
import logging
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from checkpoint_job import FiniteIds
from datasets import DEADLINE_S, Counter, take, wait_for, writer_of

from gigashuffle import CheckpointError, DataloaderConfig, MultiprocessShuffledDataloader, ShuffleBufferStats
from gigashuffle.checkpoint.parts import own_part
from gigashuffle.sources import Chunked


def _config(redis_url: str, tag: str, **overrides: Any) -> DataloaderConfig:
    settings: dict[str, Any] = dict(bs=4, shuffle_size=64, queue_name=f"{tag}-{uuid.uuid4().hex[:8]}", num_writers=1,
                                    num_readers=1, redis_url=redis_url)  # fmt: skip
    settings.update(overrides)
    return DataloaderConfig(**settings)


def _counters(batches: list[list[dict[str, torch.Tensor]]]) -> list[tuple[int, int]]:
    return [(int(writer_of(i)), int(c)) for b in batches for i, c in zip(b[0]["id"], b[0]["counter"], strict=True)]


def test_a_checkpoint_loaded_after_the_dummy_batch_is_the_first_thing_read(redis_url: str) -> None:
    """NOTE [ Restore before reading ]: the writers take a chunk for the dummy batch, then hold until the state
    comes; no row from the dataset's start reaches the buffer meanwhile."""
    cfg = _config(redis_url, "hold", num_writers=2)
    with MultiprocessShuffledDataloader(Counter(chunk=8), cfg) as loader:
        assert loader.get_dummy_batch(timeout_s=120)[0]["counter"].shape == (4,)
        time.sleep(0.5)  # what a model load would take: the writers must still hold
        assert loader.stats() == ShuffleBufferStats(full=0, empty=64, in_flight=0)
        start = {"queue": cfg.queue_name, "global_rank": 0, "global_world_size": 1, "num_writers": 2,
                 "writers": [{"pos": 1000}] * 2}  # fmt: skip
        loader.load_state_dict({"rank0": start})
        rows = _counters(take(iter(loader), 30))
    assert min(c for _w, c in rows) >= 1000, "rows from before the loaded state were read"
    assert {w for w, _c in rows} == {0, 1}


def test_state_dict_while_a_writer_is_being_killed_waits_for_its_successor(redis_url: str) -> None:
    """The issue's BrokenPipeError: a writer SIGKILLed just before ``state_dict()``."""
    cfg = _config(redis_url, "deadwriter", num_writers=2, bs=8, shuffle_size=128, max_restarts=5)
    with MultiprocessShuffledDataloader(Counter(chunk=8), cfg) as loader:
        it = iter(loader)
        for _ in range(3):
            take(it, 5)
            pid = loader.child_pids()["writer"][0]
            os.kill(pid, signal.SIGKILL)
            # Gone and reaped, and the trainer not told yet (it learns in its next pump): a send to it breaks.
            wait_for(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), f"writer {pid} to be reaped")
            state = loader.state_dict()["rank0"]
            assert len(state["writers"]) == 2 and all("pos" in w for w in state["writers"])
        take(it, 5)


class _Samples:
    """A per-sample source with a position, like a Hugging Face ``IterableDataset``."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        while self.pos < 1000:
            self.pos += 1
            yield {"x": self.pos - 1}

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


def test_chunked_forwards_its_sources_state() -> None:
    chunked = Chunked(_Samples(), rows=4)
    it = iter(chunked)
    next(it)
    assert chunked.state_dict() == {"pos": 4}, "between chunks the source is exactly past the last chunk"
    chunked.load_state_dict({"pos": 100})
    assert next(iter(chunked))[0]["x"].tolist() == [100, 101, 102, 103]
    with pytest.raises(CheckpointError, match="source list has no state_dict"):
        Chunked([{"x": 1}], rows=1).state_dict()


def test_a_chunked_source_without_state_gets_a_clear_error(redis_url: str) -> None:
    source = [{"x": i} for i in range(64)]
    with MultiprocessShuffledDataloader(Chunked(source, rows=4), _config(redis_url, "chunked")) as loader:
        with pytest.raises(CheckpointError, match=r"Chunked .* its source list has no state_dict\(\)"):
            loader.state_dict()
        take(iter(loader), 1)


def test_a_checkpoint_of_another_rank_or_a_damaged_one_is_refused() -> None:
    cfg = DataloaderConfig(bs=4, shuffle_size=64, queue_name="parts", num_writers=1, global_rank=1,
                           global_world_size=2, local_rank=0, local_world_size=1)  # fmt: skip
    mine = {"queue": "parts", "global_rank": 1, "global_world_size": 2, "num_writers": 1, "writers": [{}], "skip": [0]}
    assert own_part(cfg, {"rank0": {}, "rank1": mine})["writers"] == [{}]
    with pytest.raises(CheckpointError, match=r"no entry 'rank1' .*global rank 1 of 2.*\['rank0'\]"):
        own_part(cfg, {"rank0": mine})
    torn = {"layout": "{}", "fields": [torch.zeros(3, 4, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8)]}
    with pytest.raises(CheckpointError, match="damaged"):
        own_part(cfg, {"rank1": {**mine, "rows": torn}})
    with pytest.raises(CheckpointError, match="damaged"):
        own_part(cfg, {"rank1": {**mine, "rows": {"layout": "{}", "fields": [torch.zeros(3, 4)]}}})


def _resume_and_count(dataset: FiniteIds, cfg: DataloaderConfig, state: Any, before: list[int], ids: int) -> None:
    """Resume ``state`` and read well into the next pass: with ``before`` (ids of pass 0 read up to the checkpoint)
    every id of pass 0 must come exactly once."""
    with MultiprocessShuffledDataloader(dataset, cfg) as again:
        again.load_state_dict(state)
        it = iter(again)
        after: list[tuple[int, int]] = []
        deadline = time.monotonic() + 120
        while sum(p > 0 for _i, p in after) < 20 * 64 and time.monotonic() < deadline:
            after += [(int(i), int(p)) for b in take(it, 1) for i, p in zip(b[0]["id"], b[0]["pass"], strict=True)]
    seen = collections.Counter(before + [i for i, p in after if p == 0])
    assert sorted(seen) == list(range(ids)), f"lost {sorted(set(range(ids)) - set(seen))[:10]}"
    assert max(seen.values()) == 1, f"twice: {[i for i, n in seen.items() if n > 1][:10]}"


def test_a_checkpoint_while_the_writer_waits_inside_a_chunk_for_room_loses_none_of_it(redis_url: str) -> None:
    """A full buffer with the caller not reading: the writer waits for empty slots inside a chunk it has taken from
    its dataset. The checkpoint must name the state before that chunk and the rows of it written (NOTE [ Checkpoint
    cut ]): the resumed loader reads every id of the pass once, counting what was read before the checkpoint."""
    ids = 400
    cfg = _config(redis_url, "midchunk", bs=4, shuffle_size=64)
    with MultiprocessShuffledDataloader(FiniteIds(ids, 200), cfg) as loader:
        it = iter(loader)
        before = [int(i) for b in take(it, 5) for i in b[0]["id"]]
        wait_for(lambda: loader.stats().empty == 0, "the buffer to fill up while nobody reads")
        state = loader.state_dict()
    assert state["rank0"]["skip"][0] > 0, "the writer was inside a chunk: its state is from before it"
    _resume_and_count(FiniteIds(ids, 200), cfg, state, before, ids)  # the same queue: its checkpoint


@pytest.mark.parametrize("way", ["saved", "positions"])
def test_batches_handed_out_and_not_trained_on_come_back_after_a_resume(redis_url: str, way: str) -> None:
    """A framework that fetches ahead checkpoints with one batch more handed out than trained on: passed as
    ``state_dict(unconsumed=[batch])``, its rows are saved (by positions: re-read, found in the ring slots the
    batches still view) and come back once after the resume."""
    ids = 400
    queue = f"ahead-{uuid.uuid4().hex[:8]}"
    cfg = _config(redis_url, "ahead", queue_name=queue, checkpoint_rows=way)
    with MultiprocessShuffledDataloader(FiniteIds(ids, 20), cfg) as loader:
        it = iter(loader)
        trained = take(it, 5)
        ahead = take(it, 2)  # fetched, never trained on
        state = loader.state_dict(unconsumed=ahead)
        with pytest.raises(ValueError, match=r"unconsumed=\.\.\.\): item 0 is not a batch of this loader"):
            loader.state_dict(unconsumed=[[{"other": torch.zeros(4)}]])
        with pytest.raises(TypeError, match=r"item 0 is a dict, but this loader yields each batch as a list of dicts"):
            loader.state_dict(unconsumed=ahead[0])  # type: ignore[arg-type]
        if way == "positions":  # found by their origins, not saved as rows
            saved = state["rank0"]["rows"]
            values = (
                set(torch.cat([f.view(torch.int64).reshape(-1) for f in saved["fields"]]).tolist()) if saved else set()
            )
            assert not values & {int(i) for b in ahead for i in b[0]["id"] if int(i)}
    before = [int(i) for b in trained for i in b[0]["id"]]
    _resume_and_count(FiniteIds(ids, 20), cfg, state, before, ids)


def test_every_writer_puts_back_its_share_of_the_saved_rows(redis_url: str) -> None:
    """NOTE [ Checkpoint cut ]: a rank's saved rows are dealt to its writers, a contiguous share each, and each puts
    its share back before it reads on (writer 0 putting all back raced the others' fresh rows alone). Each writer's
    saved-rows lane in the slot table counts the rows it put back (NOTE [ Lanes ])."""
    from gigashuffle.rowblock import share_bounds
    from gigashuffle.shm.lanes import writer_lanes

    cfg = _config(redis_url, "dealt", num_writers=2)
    with MultiprocessShuffledDataloader(Counter(), cfg) as loader:
        take(iter(loader), 5)
        state = loader.state_dict()
    count = state["rank0"]["rows"]["count"]
    assert count >= 2, "the cut saved fewer than two rows: nothing to deal"
    shares = [hi - lo for lo, hi in share_bounds(count, 2)]
    saved_lanes = tuple(writer_lanes(0, i)[1] for i in range(2))
    with MultiprocessShuffledDataloader(Counter(), cfg) as resumed:
        resumed.load_state_dict(state)
        batches = iter(resumed)

        def put_back() -> tuple[int, ...] | None:
            next(batches)  # readers make room for the rows put back
            table = resumed._sup.table()
            values = table.lane_values(saved_lanes) if table is not None else None
            return values if values is not None and sum(values) == count else None

        assert wait_for(put_back, "every saved row put back") == tuple(shares)


def test_a_checkpoint_loaded_after_the_first_iter_is_warned_of(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """NOTE [ Restore before reading ]: loaded before the first ``iter()``, a checkpoint is exact; loaded after it, it
    meets rows the writers already put into the buffer from the stream it does not know (probed: 280 of 1,000 rows
    came twice), and the loader says so."""
    cfg = _config(redis_url, "late-load")
    with MultiprocessShuffledDataloader(FiniteIds(400, 20), cfg) as loader:
        take(iter(loader), 2)
        state = loader.state_dict()
    caplog.set_level(logging.WARNING, logger="gigashuffle.loader.checkpointing")

    def warned() -> int:
        return sum("load_state_dict() came after this loader's first iter()" in r.getMessage() for r in caplog.records)

    with MultiprocessShuffledDataloader(FiniteIds(400, 20), cfg) as loader:
        loader.get_dummy_batch()  # reads no batch: not too late
        loader.load_state_dict(state)
        take(iter(loader), 1)
    assert warned() == 0
    with MultiprocessShuffledDataloader(FiniteIds(400, 20), cfg) as loader:
        take(iter(loader), 1)
        loader.load_state_dict(state)
    assert warned() == 1


def test_a_writer_only_rank_whose_writers_wrote_before_its_load_is_warned_of(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank with ``num_readers=0`` never holds its writers for a checkpoint (NOTE [ Restore before reading ]): its
    writers write from the start, so a checkpoint loaded after their first commit meets rows it does not know (probed:
    64 rows twice in the saved way), and the loader says so, with the count."""
    common = dict(bs=8, shuffle_size=64, num_writers=1, local_world_size=2, global_world_size=2,
                  queue_name=f"feedonly-{uuid.uuid4().hex[:8]}", redis_url=redis_url)  # fmt: skip
    reading = DataloaderConfig(global_rank=0, local_rank=0, num_readers=1, **common)  # type: ignore[arg-type]
    feeding = DataloaderConfig(global_rank=1, local_rank=1, num_readers=0, **common)  # type: ignore[arg-type]
    state: dict[str, Any] = {}
    with (
        MultiprocessShuffledDataloader(FiniteIds(400, 20), reading) as r0,
        MultiprocessShuffledDataloader(FiniteIds(400, 20), feeding) as r1,
    ):
        take(iter(r0), 2)
        # The node's cut meets both ranks at once: rank 1's call from a thread, as from a process of its own.
        feeder = threading.Thread(target=lambda: state.update(r1.state_dict()))
        feeder.start()
        state.update(r0.state_dict())
        feeder.join(DEADLINE_S)
        assert not feeder.is_alive() and set(state) == {"rank0", "rank1"}, state.keys()
    caplog.set_level(logging.WARNING, logger="gigashuffle.loader.checkpointing")
    with MultiprocessShuffledDataloader(FiniteIds(400, 20), feeding) as r1:
        wait_for(lambda: r1.stats().full > 0, "the writer-only rank's writer to commit rows")
        r1.load_state_dict(state)
    warned = [r.getMessage() for r in caplog.records if "writer-only rank's writers put" in r.getMessage()]
    assert len(warned) == 1 and re.search(r"put [1-9]\d* rows into the node's buffer", warned[0]), warned
