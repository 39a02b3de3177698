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


# NOTE [ Chunked state ]: a Hugging Face IterableDataset answers its old state after load_state_dict until it
# iterates; Chunked answers the loaded one. With pass_field the pass is in each row and in the state, and a state
# taken at the end of a pass resumes to the (empty) rest of that pass, then the next one.
_CHILD_PASSES = """
from datasets import Dataset
from gigashuffle.sources import Chunked

def chunked():
    source = Dataset.from_dict({"id": list(range(20))}).to_iterable_dataset(num_shards=2)
    return Chunked(source.with_format("torch"), rows=6, pass_field="pass")

def one_pass(c):
    return [(i, p) for chunk in c for i, p in zip(chunk[0]["id"].tolist(), chunk[0]["pass"].tolist())]

first = chunked()
it = iter(first)
next(it)
mid = first.state_dict()
assert mid["pass"] == 0, mid
resumed = chunked()
other = iter(resumed)
next(other), next(other)  # it has read chunks of its own: the loaded state must replace that position
resumed.load_state_dict(mid)
assert resumed.state_dict() == mid, "before it reads, the state is the loaded one, not the source's last"
assert resumed.source.state_dict() != mid["source"], "(Hugging Face's own answer is stale: the reason for this)"
assert sorted(one_pass(resumed)) == [(i, 0) for i in range(6, 20)]
end = resumed.state_dict()
assert end["pass"] == 0, "the end of a pass is still that pass"
assert sorted(one_pass(resumed)) == [(i, 1) for i in range(20)]
last = chunked()
last.load_state_dict(end)
assert one_pass(last) == [] and sorted(one_pass(last)) == [(i, 1) for i in range(20)]
try:
    last.load_state_dict(end["source"])
except ValueError as exc:
    assert "pass_field='pass'" in str(exc), exc
else:
    raise AssertionError("a state without the pass was taken")
from gigashuffle.sources import missing_state_methods
shuffled = Dataset.from_dict({"id": [1, 2]}).to_iterable_dataset(num_shards=2).shuffle(seed=0, buffer_size=8)
shuffled = Chunked(shuffled, rows=1)
assert "shuffle(buffer_size=8)" in missing_state_methods(shuffled), missing_state_methods(shuffled)
print("ok")
"""


def _run_child(program: str) -> None:
    if importlib.util.find_spec("pyarrow") is None:
        pytest.skip("needs pyarrow")
    env = {**os.environ, "PYTHONPATH": str(Path.cwd()), "HF_DATASETS_OFFLINE": "1"}  # not the tests dirs
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300,
                          cwd="/", check=False)  # fmt: skip
    if "No module named 'datasets'" in done.stderr:
        pytest.skip("needs the datasets package")
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_resumed_hugging_face_source_reads_whole_passes_after_the_resumed_one() -> None:
    _run_child(_CHILD)


def test_chunked_answers_the_loaded_state_until_it_reads_and_counts_passes_in_rows_and_state() -> None:
    _run_child(_CHILD_PASSES)
