"""The README's data-source recipes, run as users run them, on data built here: ``examples/hf_datasets.py`` (a
Hugging Face ``datasets`` IterableDataset) and ``examples/webdataset_shards.py`` (webdataset tar shards, read by
``Sharded`` + ``TarReader`` or through a webdataset pipeline), each as a two-rank job with fewer shards than the job
has writers; ``gigashuffle.sources.Chunked`` refusing a source that is already split by node, and a webdataset
pipeline's checkpoint refused with the fix named; a writer whose share is empty idling instead of failing; and a
writer's reservation of empty slots for its next chunk, held while its source waits and given back before it idles.

The recipes run as subprocesses (ranks 0 and 1, one per simulated node, ``RANK``/``WORLD_SIZE`` in their
environment as torchrun sets them): the helper module next to this file is also called ``datasets`` and would
shadow Hugging Face's package in this process. Their checkpoints are tested in test_checkpoint_recipes.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import webdataset as wds
from datasets import (
    DEADLINE_S,
    FewShards,
    FirstWriterWaits,
    GatedUniqueIds,
    check_unique_batch,
    passes_by_worker,
    take,
    wait_for,
    writer_of,
)

import gigashuffle
from gigashuffle import CheckpointError, DataloaderConfig, MultiprocessShuffledDataloader, ShuffleBufferStats
from gigashuffle.sources import Chunked, FixedLength, chunks

REPO_ROOT = Path(gigashuffle.__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def _run_ranks(script: Path, args: list[str], cwd: Path, rank_args: list[list[str]]) -> list[dict[str, Any]]:
    """Run ``script`` as ranks 0, 1, ... (one per node, ``rank_args[r]`` added to ``args``); the JSON line each
    printed, failing with their output."""
    world = len(rank_args)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args, *rank_args[r]],
            cwd=cwd,
            env=_env(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outputs: list[tuple[int | None, str, str]] = []
    try:
        deadline = time.monotonic() + DEADLINE_S
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    report = "\n".join(f"--- rank {r}: exit {code}\n{out}\n{err[-4000:]}" for r, (code, out, err) in enumerate(outputs))
    assert all(code == 0 for code, _, _ in outputs), report
    return [json.loads(out.splitlines()[-1]) for _, out, _ in outputs]


def _recipe_args(redis_url: str) -> list[str]:
    # 4 writers in the job (2 per rank) and 3 shards of 20 rows: writers 0, 1, 2 read shards 0, 1, 2, writer 3
    # (rank 1's second) has none and must idle.
    return ["--rows", "60", "--shards", "3", "--num-writers", "2", "--batches", "20000", "--bs", "4",
            "--shuffle-size", "32", "--chunk-rows", "4", "--redis-url", redis_url,
            "--queue", f"recipe-{uuid.uuid4().hex[:8]}"]  # fmt: skip


# Each rank reads until it has seen every id of its share (a fixed batch count would race with a writer that
# starts late); with a source split twice it never would, and stops at --batches with a fraction instead.
# Shard k holds ids [20k, 20k + 20). Split by worker (Hugging Face, a webdataset pipeline), rank 0's writers (job-wide
# ids 0, 1) read shards 0 and 1, rank 1's writer 2 reads shard 2 and its writer 3 none. Sharded deals the rows out
# (NOTE [ Balanced pieces ] in sources/shardcursor.py): 15 to each writer, so ids [0, 30) to rank 0's two.
BY_WORKER = {0: range(40), 1: range(40, 60)}
BY_ROWS = {0: range(30), 1: range(30, 60)}


def _rank_args(split: dict[int, range]) -> list[list[str]]:
    return [["--distinct", str(len(split[r]))] for r in range(2)]


def _check_job_wide_split(results: list[dict[str, Any]], split: dict[int, range]) -> None:
    by_rank = {r["rank"]: set(r["ids"]) for r in results}
    # A second split by node would leave each rank half of its share.
    assert by_rank == {r: set(ids) for r, ids in split.items()}, {r: sorted(i) for r, i in by_rank.items()}
    assert [r["writers"] for r in results] == [2, 2], "a writer without rows died instead of idling"


@pytest.mark.usefixtures("runtime_dir")
def test_hugging_face_recipe_splits_the_shards_over_every_writer_of_the_job(redis_url: str, tmp_path: Path) -> None:
    results = _run_ranks(EXAMPLES / "hf_datasets.py", _recipe_args(redis_url), tmp_path, _rank_args(BY_WORKER))
    _check_job_wide_split(results, BY_WORKER)


@pytest.mark.parametrize("form", ["sharded", "pipeline"])
@pytest.mark.usefixtures("runtime_dir")
def test_webdataset_recipe_splits_the_shards_over_every_writer_of_the_job(
    redis_url: str, tmp_path: Path, form: str
) -> None:
    """Both forms of the recipe: ``Sharded`` + ``TarReader`` (the default, checkpointable, rows dealt out by rows)
    and a webdataset pipeline in ``Chunked`` (``--pipeline``, shards split by worker): every row once, job-wide."""
    made = subprocess.run(
        [sys.executable, str(EXAMPLES / "webdataset_shards.py"), "--write-shards", str(tmp_path / "shards"),
         "--shards", "3", "--rows", "60"],
        env=_env(), capture_output=True, text=True, timeout=DEADLINE_S, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    urls = made.stdout.strip()
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [f"shard-{i:06d}.tar" for i in range(3)]
    pipeline = ["--pipeline"] if form == "pipeline" else []
    split = BY_WORKER if form == "pipeline" else BY_ROWS
    results = _run_ranks(
        EXAMPLES / "webdataset_shards.py",
        ["--urls", urls, *pipeline, *_recipe_args(redis_url)],
        tmp_path,
        _rank_args(split),
    )
    _check_job_wide_split(results, split)


def test_a_webdataset_pipeline_cannot_checkpoint_and_the_error_names_the_tar_reader(
    redis_url: str, tmp_path: Path
) -> None:
    made = subprocess.run(
        [sys.executable, str(EXAMPLES / "webdataset_shards.py"), "--write-shards", str(tmp_path), "--shards", "1",
         "--rows", "32"],
        env=_env(), capture_output=True, text=True, timeout=DEADLINE_S, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    source = wds.WebDataset(made.stdout.strip(), nodesplitter=None, shardshuffle=False, empty_check=False).decode()
    dataset = Chunked(source, rows=4, transform=lambda s: {"id": s["id.cls"]})
    cfg = DataloaderConfig(bs=4, shuffle_size=32, queue_name=f"wds-state-{uuid.uuid4().hex[:8]}", num_writers=1,
                           num_readers=1, redis_url=redis_url)  # fmt: skip
    with MultiprocessShuffledDataloader(dataset, cfg) as loader:
        with pytest.raises(CheckpointError, match=r"webdataset pipeline .*Sharded\(shards, TarReader\("):
            loader.state_dict()
        assert take(iter(loader), 1)[0][0]["id"].shape == (4,), "the loader reads on after the refusal"


class _Tokenized:
    """Token ids of 1 to 11 per sample, as a tokenizer gives them: ``id`` 0.. with ``id % 11 + 1`` tokens."""

    def __iter__(self) -> Any:
        for i in range(400):
            yield {"id": i, "input_ids": list(range(100, 100 + i % 11 + 1))}


def test_variable_length_token_ids_reach_the_trainer_padded_with_their_lengths(redis_url: str) -> None:
    """A source of token ids of many lengths: without a transform its chunks cannot be stacked (the writer's error
    names the field and FixedLength); with ``FixedLength`` every row arrives cut or padded, its length beside it."""
    cfg = DataloaderConfig(bs=8, shuffle_size=64, queue_name=f"varlen-{uuid.uuid4().hex[:8]}", num_writers=1,
                           num_readers=1, redis_url=redis_url)  # fmt: skip
    unstackable = r"field 'input_ids' has values of different shapes.*FixedLength"
    with (
        MultiprocessShuffledDataloader(Chunked(_Tokenized(), rows=8), cfg) as loader,
        pytest.raises(gigashuffle.WorkerDied, match=unstackable),
    ):
        take(iter(loader), 1)
    fixed = Chunked(_Tokenized(), rows=8, transform=FixedLength({"input_ids": 8}, pad=0))
    with MultiprocessShuffledDataloader(fixed, replace(cfg, queue_name=f"{cfg.queue_name}-fixed")) as loader:
        for batch in take(iter(loader), 20):
            group = batch[0]
            assert group["input_ids"].shape == (8, 8)
            for i, ids, n in zip(group["id"].tolist(), group["input_ids"].tolist(), group["input_ids_length"].tolist()):
                assert n == min(i % 11 + 1, 8) and ids == list(range(100, 100 + n)) + [0] * (8 - n)


def test_a_hugging_face_dataset_split_by_node_is_refused(tmp_path: Path) -> None:
    program = (
        "from datasets import Dataset\n"
        "from datasets.distributed import split_dataset_by_node\n"
        "from gigashuffle.sources import Chunked\n"
        "ds = Dataset.from_dict({'x': list(range(8))}).to_iterable_dataset(num_shards=4)\n"
        "Chunked(ds, rows=2)\n"
        "try:\n"
        "    Chunked(split_dataset_by_node(ds, rank=1, world_size=2), rows=2)\n"
        "except ValueError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=DEADLINE_S, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED" in proc.stdout, proc.stdout + proc.stderr
    assert "split_dataset_by_node(rank=1, world_size=2)" in proc.stdout and "1/world_size" in proc.stdout


def test_a_webdataset_split_by_node_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    urls = str(tmp_path / "shard-{000000..000001}.tar")
    Chunked(wds.WebDataset(urls, nodesplitter=None, shardshuffle=False), rows=2)
    with pytest.raises(ValueError, match=r"webdataset\.split_by_node.*1/world_size"):
        Chunked(wds.WebDataset(urls, nodesplitter=wds.split_by_node, shardshuffle=False), rows=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"nodesplitter=None"):
        Chunked(wds.WebDataset(urls, shardshuffle=False), rows=2)


def test_chunks_stack_samples_into_chunks_of_the_given_size() -> None:
    samples = [{"__key__": f"k{i}", "id": i, "x": torch.full((2,), float(i)), "flag": i % 2 == 0} for i in range(7)]
    got = list(chunks(iter(samples), 3))
    assert [len(c[0]["id"]) for c in got] == [3, 3, 1]
    assert set(got[0][0]) == {"id", "x", "flag"}, "dunder fields (webdataset's __key__) stay out"
    assert torch.equal(torch.cat([c[0]["id"] for c in got]), torch.arange(7))
    assert got[0][0]["x"].shape == (3, 2) and got[0][0]["flag"].dtype == torch.bool
    with pytest.raises(TypeError, match="'name' is a str"):
        list(chunks([{"name": "a"}], 1))
    with pytest.raises(ValueError, match="rows=0"):
        Chunked([], rows=0)


def test_a_writer_whose_share_is_empty_idles_instead_of_failing(redis_url: str, tmp_path: Path) -> None:
    """3 writers, 1 shard: writers 1 and 2 end writer_max_retries + 1 passes without a chunk, then stop trying
    (no busy loop), stay alive, answer state_dict, and try again after load_state_dict."""
    passes = str(tmp_path / "passes")
    retries = 3
    # Writer 0 waits first_mix_wait_s for the others' first-mix shares, which never come (NOTE [ First mix ]).
    cfg = DataloaderConfig(bs=4, shuffle_size=32, queue_name=f"empty-share-{uuid.uuid4().hex[:8]}", num_writers=3,
                           num_readers=1, writer_max_retries=retries, redis_url=redis_url,
                           first_mix_wait_s=1.0)  # fmt: skip
    with MultiprocessShuffledDataloader(FewShards(shards=1, passes_file=passes), cfg) as loader:
        it = iter(loader)
        idle = {1: retries + 1, 2: retries + 1}
        wait_for(lambda: {w: n for w, n in passes_by_worker(passes).items() if w in idle} == idle,
                 "writers 1 and 2 to give up on their empty shares")  # fmt: skip
        for batch in take(it, 40):  # the job goes on, fed by writer 0 alone
            assert {int(w) for w in writer_of(torch.tensor(check_unique_batch(batch, 4, 32)))} == {0}
        assert {w: n for w, n in passes_by_worker(passes).items() if w in idle} == idle, "idle writers kept trying"
        assert len(loader.child_pids()["writer"]) == 3
        state = loader.state_dict()["rank0"]
        assert state["writers"] == [{"resumed": 0}] * 3, "idle writers must still answer state_dict"
        loader.load_state_dict({"rank0": {**state, "writers": [{"resumed": 1}] * 3}})
        again = {1: 2 * (retries + 1), 2: 2 * (retries + 1)}
        wait_for(lambda: {w: n for w, n in passes_by_worker(passes).items() if w in again} == again,
                 "idle writers to try their dataset again after load_state_dict")  # fmt: skip
        check_unique_batch(take(it, 1)[0], 4, 32)


def test_a_writer_reserves_its_next_chunk_while_its_source_waits_and_gives_the_slots_back_before_idling(
    redis_url: str, tmp_path: Path
) -> None:
    """A writer publishes each chunk and reserves empty slots for the next one (NOTE [ Writer cycle ]): while its
    source waits, every row it wrote is full (visible) and only the reservation is in flight. When a resumed state
    leaves its share empty it idles, and first gives the reservation back: nothing stays in flight."""
    allowed = tmp_path / "allowed"
    allowed.write_text("3")
    cfg = DataloaderConfig(bs=4, shuffle_size=64, queue_name=f"reserve-{uuid.uuid4().hex[:8]}", num_writers=1,
                           num_readers=0, writer_max_retries=2, redis_url=redis_url)  # fmt: skip
    with MultiprocessShuffledDataloader(GatedUniqueIds(str(allowed)), cfg) as loader:
        wait_for(lambda: loader.stats() == ShuffleBufferStats(full=12, empty=48, in_flight=4),
                 "3 chunks published and 4 slots reserved for the 4th")  # fmt: skip
        # The writer is parked in the source, so it cannot answer state_dict(): the state is built by hand.
        loader.load_state_dict({"rank0": {"queue": cfg.queue_name, "global_world_size": 1, "num_writers": 1,
                                          "global_rank": 0, "writers": [{"resumed": 1}]}})  # fmt: skip
        allowed.write_text("4")  # the 4th chunk goes into the reservation; then its share is empty
        wait_for(lambda: loader.stats() == ShuffleBufferStats(full=16, empty=48, in_flight=0),
                 "the 4th chunk published and the next reservation given back")  # fmt: skip


def test_rows_a_writer_copied_are_published_while_its_dataset_waits(redis_url: str, tmp_path: Path) -> None:
    """A writer with its next chunks reserved publishes once per four chunks (NOTE [ Deferred commits ]), yet rows
    it copied never stay invisible while its dataset waits for data: its watcher thread publishes them."""
    allowed = tmp_path / "allowed"
    allowed.write_text("2")
    cfg = DataloaderConfig(bs=8, shuffle_size=1024, queue_name=f"pending-{uuid.uuid4().hex[:8]}", num_writers=1,
                           num_readers=0, redis_url=redis_url)  # fmt: skip
    with MultiprocessShuffledDataloader(GatedUniqueIds(str(allowed), chunk=16), cfg) as loader:
        # Chunk 1 is published with a reservation of 64 slots (4 chunks); chunk 2 goes into it and stays pending
        # until the watcher publishes it, the writer being parked in the source.
        wait_for(lambda: loader.stats() == ShuffleBufferStats(full=32, empty=1024 - 32 - 48, in_flight=48),
                 "both chunks published while the source waits, 48 slots still reserved")  # fmt: skip
        allowed.write_text("4")
        wait_for(lambda: loader.stats() == ShuffleBufferStats(full=64, empty=1024 - 64 - 16, in_flight=16),
                 "chunks 3 and 4 published while the source waits again")  # fmt: skip


def test_fill_once_fills_every_slot_while_one_writer_waits_for_data(redis_url: str, tmp_path: Path) -> None:
    """With fill_once a writer reserves nothing ahead (NOTE [ Writer cycle ]): the last empty slots go to whichever
    writer has rows, so a writer whose source waits cannot keep the buffer from filling, and the pass starts."""
    slots, gate = 64, tmp_path / "gate"
    # Writer 1 waits first_mix_wait_s for writer 0's first-mix share, which never comes (NOTE [ First mix ]).
    cfg = DataloaderConfig(bs=4, shuffle_size=slots, queue_name=f"fill-wait-{uuid.uuid4().hex[:8]}", num_writers=2,
                           num_readers=1, fill_once=True, min_mixing=1.0, redis_url=redis_url,
                           first_mix_wait_s=1.0)  # fmt: skip
    with MultiprocessShuffledDataloader(FirstWriterWaits(str(gate), chunk=4), cfg) as loader:
        wait_for(lambda: loader.stats().full == 4 or None, "writer 0's one chunk published")
        gate.touch()  # writer 1 starts; writer 0 waits in its source from now on
        full = wait_for(lambda: s if (s := loader.stats()).full == slots else None, "every slot full")
        assert full == ShuffleBufferStats(full=slots, empty=0, in_flight=0)
        ids = [i for batch in loader for i in batch[0]["id"].tolist()]
    assert len(ids) == slots and len(set(ids)) == slots, "one pass: every slot's row once"
    assert sum(writer_of(i) == 0 for i in ids) == 4 and sum(writer_of(i) == 1 for i in ids) == slots - 4


@pytest.mark.parametrize(
    ("script", "package", "args"),
    [("hf_datasets.py", "datasets", []), ("webdataset_shards.py", "webdataset", ["--write-shards", "/nonexistent"])],
)
def test_a_recipe_without_its_package_says_what_to_install_in_one_line(
    script: str, package: str, args: list[str]
) -> None:
    """A missing ``datasets`` or ``webdataset`` surfaced as an ImportError traceback (under torchrun, as its
    ChildFailedError): the recipe now names the package in one line and exits with code 2. (The webdataset recipe
    reads tar shards without the package; it needs it to write them.)"""
    path = EXAMPLES / script
    hide_and_run = (
        f"import runpy, sys; sys.modules[{package!r}] = None; sys.argv = [{str(path)!r}, *{args!r}]; "
        f"runpy.run_path({str(path)!r}, run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", hide_and_run], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines() == [f"{path} needs the {package!r} package: pip install {package}"]
    assert package in path.read_text().split('"""')[1]  # the docstring names it too
