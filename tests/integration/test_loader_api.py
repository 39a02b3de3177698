"""The rest of the public API with real processes: training context, checkpoints, worker info, errors that come
from the children, and teardown (close, context manager, finalizer) without leaks."""

from __future__ import annotations

import gc
import re
import time
import uuid
from pathlib import Path
from typing import Any

import leaks
import pytest
import redis
import torch
from datasets import (
    DEADLINE_S,
    ID_STRIDE,
    RAISE_TEXT,
    ContextEcho,
    Counter,
    DtypeChangesLater,
    NoRows,
    OnlyEmptyChunks,
    RaisesInIter,
    UniqueIds,
    Unpicklable,
    UsesIndexKey,
    WorkerInfoEcho,
    check_unique_batch,
    poll,
    take,
    writer_of,
)

from gigashuffle import (
    INDEX_KEY,
    CheckpointError,
    ConfigMismatchError,
    DataloaderConfig,
    GigashuffleError,
    MultiprocessShuffledDataloader,
    SchemaError,
    WorkerDied,
)
from gigashuffle.schema import Layout

KEY_PATTERN = "gigashuffle:{*"


def _queue(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def _config(redis_url: str, tag: str, **overrides: Any) -> DataloaderConfig:
    settings: dict[str, Any] = dict(
        bs=4, shuffle_size=64, queue_name=_queue(tag), num_writers=1, num_readers=1, redis_url=redis_url
    )
    settings.update(overrides)
    return DataloaderConfig(**settings)


# -- training context ------------------------------------------------------------------------------------------


def test_attach_training_context_reaches_the_writers(redis_url: str) -> None:
    cfg = _config(redis_url, "ctx", num_writers=2)
    with MultiprocessShuffledDataloader(ContextEcho(chunk=4), cfg) as loader:
        it = iter(loader)
        first = take(it, 1)[0]
        assert first[0]["ctx"].dtype == torch.int64
        loader.attach_training_context(7)
        poll(it, lambda b: bool((b[0]["ctx"] == 7).any()), "context 7")
        loader.attach_training_context({"step": 11})  # any picklable object
        batch = poll(it, lambda b: bool((b[0]["ctx"] == 11).any()), "context 11")
        # Once a writer has the new context, it never goes back: no row written later carries an old one.
        assert set(batch[0]["ctx"].tolist()) <= {-1, 7, 11}
        # Both writers got it.
        writers_with_11: set[int] = set()
        deadline = time.monotonic() + DEADLINE_S
        while writers_with_11 != {0, 1}:
            assert time.monotonic() < deadline, f"only writers {writers_with_11} saw the context"
            b = take(it, 1)[0]
            writers_with_11.update(int(writer_of(i)) for i in b[0]["id"][b[0]["ctx"] == 11])


# -- checkpoints -----------------------------------------------------------------------------------------------


def _rows(batches: list[list[dict[str, torch.Tensor]]]) -> list[tuple[int, int]]:
    """(writer, counter) of every row."""
    out = []
    for batch in batches:
        for i, c in zip(batch[0]["id"].tolist(), batch[0]["counter"].tolist(), strict=True):
            assert i % ID_STRIDE == c
            out.append((int(writer_of(i)), c))
    return out


def test_state_dict_resumes_each_writer_where_it_was(redis_url: str) -> None:
    cfg = _config(redis_url, "state", num_writers=2, bs=8)
    with MultiprocessShuffledDataloader(Counter(chunk=8), cfg) as loader:
        rows = _rows(take(iter(loader), 20))
        state = loader.state_dict()
    assert list(state) == ["rank0"], "the state is keyed by global rank"
    mine = state["rank0"]
    assert mine["global_rank"] == 0 and mine["global_world_size"] == 1 and mine["num_writers"] == 2
    assert len(mine["writers"]) == 2 and mine["skip"] == [0, 0]
    positions = [w["pos"] for w in mine["writers"]]
    assert sum(positions) >= len(rows)  # rows read <= rows generated
    for writer, counter in rows:
        assert counter < positions[writer], "the state counts every row already produced"

    # The rows read and not delivered before the checkpoint are saved with it and come back first (NOTE
    # [ Checkpoint cut ]); every other row comes from at or after each writer's position.
    saved = mine["rows"]
    layout = Layout.from_json(saved["layout"])
    column = next(n for n, f in enumerate(layout.fields) if f.key == "id")
    saved_ids = set(saved["fields"][column].view(torch.int64).reshape(-1).tolist())
    assert saved_ids, "the buffer's rows are saved"
    with MultiprocessShuffledDataloader(Counter(chunk=8), cfg) as resumed:
        resumed.load_state_dict(state)
        after = _rows(take(iter(resumed), 20))
        assert after
        for writer, counter in after:
            assert counter >= positions[writer] or writer * ID_STRIDE + counter in saved_ids, (
                f"writer {writer} restarted below its checkpoint {positions} with a row that was not saved"
            )
        again = resumed.state_dict()["rank0"]
        assert all(a["pos"] >= p for a, p in zip(again["writers"], positions, strict=True))


def test_load_state_dict_refuses_another_world_size(redis_url: str) -> None:
    cfg = _config(redis_url, "state-ws")
    with MultiprocessShuffledDataloader(Counter(), cfg) as loader:
        state = loader.state_dict()
        assert len(state["rank0"]["writers"]) == 1
        for key, value in (("global_world_size", 2), ("num_writers", 2), ("global_rank", 1)):
            with pytest.raises(CheckpointError, match=key):
                loader.load_state_dict({"rank0": {**state["rank0"], key: value}})
        with pytest.raises(CheckpointError, match=r"no entry 'rank0'.*global rank 0 of 1.*\['rank1'\]"):
            loader.load_state_dict({"rank1": state["rank0"]})
        with pytest.raises(CheckpointError, match="skip"):
            loader.load_state_dict({"rank0": {**state["rank0"], "skip": [-1]}})
        loader.load_state_dict({"rank7": {}, **state})  # the right one is accepted, from a merged dict
        take(iter(loader), 1)


def test_load_state_dict_refuses_another_world_size_across_loaders(redis_url: str) -> None:
    """A checkpoint of a 1-rank job loaded into rank 0 of a 2-rank job (a real loader with that config)."""
    with MultiprocessShuffledDataloader(Counter(), _config(redis_url, "ws1")) as one:
        state = one.state_dict()
    cfg2 = _config(redis_url, "ws2", global_world_size=2, global_rank=0, local_world_size=1)
    with (
        MultiprocessShuffledDataloader(Counter(), cfg2) as two,
        pytest.raises(CheckpointError, match="global_world_size"),
    ):
        two.load_state_dict(state)


def test_state_dict_needs_a_stateful_dataset(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, "nostate")) as loader:
        with pytest.raises(CheckpointError, match=r"state_dict: the dataset UniqueIds .* has no state_dict"):
            loader.state_dict()
        with pytest.raises(CheckpointError, match="load_state_dict: the dataset UniqueIds"):
            loader.load_state_dict({"rank0": {"global_rank": 0, "global_world_size": 1, "num_writers": 1,
                                              "writers": [{}], "queue": loader.config.queue_name}})  # fmt: skip
        check_unique_batch(take(iter(loader), 1)[0], 4, 64)


# -- worker info -----------------------------------------------------------------------------------------------


def test_writers_see_their_global_worker_info(redis_url: str) -> None:
    """Rank 1 of a 2-rank job (simulated in one process, one rank per node): writer ids 2 and 3 of 4."""
    cfg = _config(redis_url, "winfo", num_writers=2, global_rank=1, global_world_size=2, local_world_size=1)
    assert cfg.node == "n1"
    with MultiprocessShuffledDataloader(WorkerInfoEcho(), cfg) as loader:
        it = iter(loader)
        wids: set[int] = set()
        deadline = time.monotonic() + DEADLINE_S
        while wids != {2, 3}:
            assert time.monotonic() < deadline, f"saw worker ids {wids}"
            group = take(it, 1)[0][0]
            wids.update(group["wid"].tolist())
            assert wids <= {2, 3}
            assert set(group["nw"].tolist()) == {4}
            assert bool(group["is_self"].all()), "get_worker_info().dataset is the writer's dataset"
            assert torch.equal(writer_of(group["id"]), group["wid"])
        # The children are registered on node n1 under rank 1.
        assert {info["rank"] for info in loader.processes().values()} == {1}
        assert loader.redis_client().exists(f"gigashuffle:{{{cfg.queue_name}@n1}}:gen")


# -- errors from the children ----------------------------------------------------------------------------------


def _next_error(loader: MultiprocessShuffledDataloader) -> BaseException:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            next(iter(loader))
        except BaseException as exc:  # the test inspects whatever came out
            return exc
    raise AssertionError(f"no error within {DEADLINE_S}s")


def test_a_later_chunk_with_another_dtype_fails_in_the_trainer(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(DtypeChangesLater(), _config(redis_url, "dtype", num_writers=2)) as loader:
        err = _next_error(loader)
        assert isinstance(err, WorkerDied), repr(err)
        assert err.role == "writer" and err.exitcode == 1 and err.signal is None
        assert err.queue == loader.config.queue_name
        message = str(err)
        assert "chunk[0]['x']" in message
        assert "float32" in message and "int64" in message
        assert "Traceback (most recent call last)" in message and "SchemaError" in message
        assert "Traceback (most recent call last)" in err.traceback_text
        # The reference loader's wording, which its users' tests match: a RuntimeError saying "child ... died",
        # then ours (who, and how).
        assert isinstance(err, RuntimeError)
        assert re.match(r"gigashuffle writer \d \(child pid \d+\) of queue '[^']+' died: exited with code 1", message)
        # The failure sticks: every later call raises it too, and close() still works.
        with pytest.raises(WorkerDied):
            next(iter(loader))
        with pytest.raises(WorkerDied):
            loader.stats()
    assert loader.closed


def test_an_exception_in_dataset_iter_reaches_the_trainer(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(RaisesInIter(), _config(redis_url, "raise")) as loader:
        err = _next_error(loader)
        assert isinstance(err, WorkerDied), repr(err)
        assert RAISE_TEXT in str(err) and "RuntimeError" in str(err)
        assert "RaisesInIter" in err.traceback_text or "__iter__" in err.traceback_text


def test_only_empty_chunks_fail_after_writer_max_retries(redis_url: str) -> None:
    cfg = _config(redis_url, "empty", writer_max_retries=3)
    with MultiprocessShuffledDataloader(OnlyEmptyChunks(), cfg) as loader:
        err = _next_error(loader)
        assert isinstance(err, WorkerDied), repr(err)
        assert "empty chunks" in str(err) and "writer_max_retries=3" in str(err)


def test_a_dataset_without_a_single_row_fails_next_and_get_dummy_batch_instead_of_waiting(redis_url: str) -> None:
    """NOTE [ Empty shares ]: every writer's __iter__ ends without a chunk (a glob that matched nothing). The writers
    idle as on an empty share, and their own error would come ``_EMPTY_SHARE_GRACE_S`` (300 s) later as a
    ``WorkerDied``: the trainer waiting for a batch, or for the dummy batch, sees the node can have no row and raises
    a ``SchemaError`` itself, ``EMPTY_NODE_S`` into it."""
    cfg = _config(redis_url, "norows", num_writers=2, writer_max_retries=3)
    expected = r"every writer of node 'n0' \(2: num_writers=2 x local_world_size=1\) found its share of the dataset "
    with MultiprocessShuffledDataloader(NoRows(), cfg) as loader:
        err = _next_error(loader)
        assert type(err) is SchemaError, repr(err)
        assert re.search(expected, str(err)) and "writer_max_retries+1=4 times" in str(err), str(err)
    # get_dummy_batch's timeout_s: the wait would otherwise end with another error.
    with MultiprocessShuffledDataloader(NoRows(), cfg) as loader, pytest.raises(SchemaError, match=expected):
        loader.get_dummy_batch(timeout_s=DEADLINE_S)


def test_an_endless_loader_is_true_in_a_condition_and_says_what_it_is(redis_url: str) -> None:
    """``if loader:`` must not fall back to ``len()``, which an endless loader raises as a TypeError."""
    loader = MultiprocessShuffledDataloader(Counter(), _config(redis_url, "truth"))
    try:
        with pytest.raises(TypeError, match="steps_per_epoch"):
            len(loader)
        assert loader and bool(loader) is True
        name = loader.config.queue_name
        assert repr(loader) == f"<MultiprocessShuffledDataloader queue={name!r} rank=0 bs=4 shuffle_size=64 open>"
    finally:
        loader.close()
    assert loader and repr(loader).endswith(" closed>")


def test_an_unpicklable_dataset_is_refused_at_construction(redis_url: str, runtime_dir: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    client.ping()
    kw: dict[str, Any] = dict(redis_client=client, key_pattern=KEY_PATTERN, runtime_dir=runtime_dir)
    before = leaks.snapshot(**kw, shm_pattern="*gigashuffle*")
    with pytest.raises(TypeError, match="cannot be pickled"):
        MultiprocessShuffledDataloader(Unpicklable(), _config(redis_url, "pickle"))
    gc.collect()
    leaks.assert_no_leaks(before, deadline_s=15, shm_pattern="*gigashuffle*", **kw)
    client.close()


def test_a_second_rank_with_other_settings_is_refused(redis_url: str) -> None:
    queue = _queue("mismatch")
    # Rank 1 never runs: rank 0's writer fills past the node's first mix without waiting for rank 1's.
    common = dict(queue_name=queue, shuffle_size=64, num_writers=1, num_readers=1, local_world_size=2,
                  global_world_size=2, redis_url=redis_url, first_mix_wait_s=0.0)  # fmt: skip
    with MultiprocessShuffledDataloader(UniqueIds(), DataloaderConfig(bs=4, **common)) as rank0:  # type: ignore[arg-type]
        other = DataloaderConfig(bs=8, local_rank=1, global_rank=1, **common)  # type: ignore[arg-type]
        with pytest.raises(ConfigMismatchError, match="bs"):
            MultiprocessShuffledDataloader(UniqueIds(), other)
        check_unique_batch(take(iter(rank0), 1)[0], 4, 64)


def test_two_ranks_of_one_node_share_one_buffer(redis_url: str) -> None:
    queue = _queue("node")
    common = dict(bs=4, queue_name=queue, shuffle_size=64, num_writers=1, num_readers=1, local_world_size=2,
                  global_world_size=2, redis_url=redis_url)  # fmt: skip
    loaders = [
        MultiprocessShuffledDataloader(UniqueIds(), DataloaderConfig(local_rank=r, global_rank=r, **common))  # type: ignore[arg-type]
        for r in (0, 1)
    ]
    try:
        iterators = [iter(loader) for loader in loaders]
        seen: set[int] = set()
        writers_seen: list[set[int]] = [set(), set()]
        deadline = time.monotonic() + DEADLINE_S
        while writers_seen != [{0, 1}, {0, 1}]:
            assert time.monotonic() < deadline, f"writers seen by each rank: {writers_seen}"
            for rank, it in enumerate(iterators):
                ids = check_unique_batch(take(it, 1)[0], 4, 64)
                assert not seen.intersection(ids), "a row was read twice across the node"
                seen.update(ids)
                writers_seen[rank].update(int(writer_of(i)) for i in ids)
    finally:
        for loader in loaders:
            loader.close()


# -- teardown and leaks ----------------------------------------------------------------------------------------


def _leak_args(redis_url: str, runtime_dir: Path) -> tuple[redis.Redis, dict[str, Any]]:
    client = redis.Redis.from_url(redis_url)
    client.ping()  # the client's own connection exists before the snapshot counts fds
    return client, dict(redis_client=client, key_pattern=KEY_PATTERN, runtime_dir=runtime_dir,
                        shm_pattern="*gigashuffle*")  # fmt: skip


def test_close_leaves_nothing_behind(redis_url: str, runtime_dir: Path) -> None:
    client, kw = _leak_args(redis_url, runtime_dir)
    before = leaks.snapshot(**kw)
    loader = MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, "leak", num_writers=2, num_readers=2))
    held = take(iter(loader), 5)
    assert client.keys(KEY_PATTERN), "the loader keeps its state in Redis while open"
    assert len(loader.child_pids()["writer"]) + len(loader.child_pids()["reader"]) == 4
    loader.close()
    loader.close()  # idempotent
    assert loader.closed
    with pytest.raises(GigashuffleError, match="closed"):
        next(iter(loader))
    with pytest.raises(GigashuffleError, match="closed"):
        loader.stats()
    # Batches still held after close() stay readable.
    for batch in held:
        check_unique_batch(batch, 4, 64)
    # A batch keeps its ring mapped (and the mapping's fd open) while it lives; then that goes too.
    del held, batch
    leaks.assert_no_leaks(before, deadline_s=15, **kw)
    client.close()


def test_context_manager_closes_even_on_error(redis_url: str, runtime_dir: Path) -> None:
    client, kw = _leak_args(redis_url, runtime_dir)
    before = leaks.snapshot(**kw)
    with (
        pytest.raises(KeyError, match="boom"),
        MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, "cm")) as loader,
    ):
        take(iter(loader), 1)
        raise KeyError("boom")
    assert loader.closed
    leaks.assert_no_leaks(before, deadline_s=15, **kw)
    client.close()


def test_a_dropped_loader_is_cleaned_by_its_finalizer(redis_url: str, runtime_dir: Path) -> None:
    client, kw = _leak_args(redis_url, runtime_dir)
    before = leaks.snapshot(**kw)
    loader = MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, "drop"))
    it = iter(loader)
    batch = take(it, 2)[-1]
    check_unique_batch(batch, 4, 64)
    del it, loader, batch
    gc.collect()
    leaks.assert_no_leaks(before, deadline_s=15, **kw)
    client.close()


def test_close_before_any_batch_and_during_start(redis_url: str, runtime_dir: Path) -> None:
    """Closing at once, while the zygote is still starting its children, leaves nothing either."""
    client, kw = _leak_args(redis_url, runtime_dir)
    before = leaks.snapshot(**kw)
    MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, "early")).close()
    loader = MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, "early2"))
    loader.wait_started()
    assert all(loader.child_pids()[role] for role in ("zygote", "writer", "reader"))
    loader.close()
    leaks.assert_no_leaks(before, deadline_s=15, **kw)
    client.close()


def test_index_key_is_reserved(redis_url: str) -> None:
    """A dataset may not use INDEX_KEY in its first group (the batch carries the slot indices there)."""
    with MultiprocessShuffledDataloader(UsesIndexKey(), _config(redis_url, "reserved")) as loader:
        err = _next_error(loader)
        assert isinstance(err, WorkerDied), repr(err)
        assert INDEX_KEY in str(err) and "reserved" in str(err)


def test_child_pids_are_complete_right_after_construction(redis_url: str) -> None:
    """The zygote forks the children after the constructor returns: child_pids() waits for their pids rather than
    answering with empty lists."""
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, "pids", num_writers=2)) as loader:
        pids = loader.child_pids()
        assert (len(pids["zygote"]), len(pids["writer"]), len(pids["reader"])) == (1, 2, 1), pids
        assert all(pid > 0 for role in pids.values() for pid in role)
