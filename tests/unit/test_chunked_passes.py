"""``sources.Chunked`` over a Hugging Face ``IterableDataset``: every row once per pass across a resume.

It runs in a child interpreter: the integration tests' helper module ``datasets`` shadows Hugging Face's in a pytest
session that collects both."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = """
from datasets import Dataset
from gigashuffle.sources import Chunked

def chunked():
    source = Dataset.from_dict({"id": list(range(40))}).to_iterable_dataset(num_shards=4)
    return Chunked(source.with_format("torch"), rows=6)

def one_pass(c):
    return [i for chunk in c for i in chunk[0]["id"].tolist()]

first = chunked()
it = iter(first)
before = [i for _ in range(3) for i in next(it)[0]["id"].tolist()]
again = chunked()
again.load_state_dict(first.state_dict())
assert sorted(before + one_pass(again)) == list(range(40)), "the resumed pass: every row once"
assert sorted(one_pass(again)) == list(range(40)), "the pass after a resume starts at the start"
third = chunked()
third.load_state_dict(again.state_dict())  # the end of a pass: nothing of it is left, then a whole pass
assert one_pass(third) == []
assert sorted(one_pass(third)) == list(range(40))
print("ok")
"""


def test_a_resumed_hugging_face_source_reads_whole_passes_after_the_resumed_one() -> None:
    if importlib.util.find_spec("pyarrow") is None:
        pytest.skip("needs pyarrow")
    env = {**os.environ, "PYTHONPATH": str(Path.cwd()), "HF_DATASETS_OFFLINE": "1"}  # not the tests dirs
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300,
                          cwd="/", check=False)  # fmt: skip
    if "No module named 'datasets'" in done.stderr:
        pytest.skip("needs the datasets package")
    assert done.stdout.strip() == "ok", done.stderr[-3000:]
