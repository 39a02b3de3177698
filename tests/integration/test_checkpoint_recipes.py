"""The README's data-source recipes checkpoint and resume exactly: the scenario of test_checkpoint_exact.py in two
segments (checkpoint, read on, SIGKILL, resume in a new process: a fresh start's checkpoint, then a resumed
source's; a last segment drains) over

* the Hugging Face recipe: ``Chunked(load_dataset("parquet", ..., streaming=True).with_format("torch"), ...)`` over
  4 parquet shards for 2 writers (its state is the IterableDataset's own: NOTE [ Chunked state ] in sources/chunked.py);
* the webdataset recipe: ``Sharded(tar shards, TarReader(transform=...), ...)`` over 4 tar shards (its state is a
  shard cursor: NOTE [ Tar shards ] in tarshards.py, NOTE [ Shard cursor ]).

The rows counted up to each checkpoint plus everything the last segment read must be every id of pass 0 once. Small
(300 ids per writer, 128 slots) so that each runs in seconds; the finite dataset's variant has the larger figures.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from checkpoint_job import write_shards
from test_checkpoint_exact import run_scenario

IDS, SHUFFLE = 300, 128


def _scenario(kind: str, redis_url: str, tmp: Path) -> tuple[int, int]:
    write_shards(kind, tmp / "data", IDS)
    lost, twice, _ = run_scenario(redis_url, tmp, dataset=("--dataset", kind, "--data", str(tmp / "data")), ids=IDS,
                                  shuffle=SHUFFLE, before=8, after=6, drain_s=60, segments=2)  # fmt: skip
    return lost, twice


def test_the_hugging_face_recipe_resumes_every_row_of_the_pass_once(redis_url: str, tmp_path: Path) -> None:
    if importlib.util.find_spec("pyarrow") is None:
        pytest.skip("needs pyarrow")
    assert _scenario("hf", redis_url, tmp_path) == (0, 0)


def test_the_webdataset_recipe_over_tar_shards_resumes_every_row_of_the_pass_once(
    redis_url: str, tmp_path: Path
) -> None:
    assert _scenario("tar", redis_url, tmp_path) == (0, 0)
