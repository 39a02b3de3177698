"""``sources.Chunked`` over a Hugging Face ``IterableDataset``: every row once per pass across a resume."""

from __future__ import annotations

import pytest

from gigashuffle.sources import Chunked

datasets = pytest.importorskip("datasets")


def _chunked() -> Chunked:
    source = datasets.Dataset.from_dict({"id": list(range(40))}).to_iterable_dataset(num_shards=4)
    return Chunked(source.with_format("torch"), rows=6)


def _pass(chunked: Chunked) -> list[int]:
    return [i for chunk in chunked for i in chunk[0]["id"].tolist()]


def test_a_resumed_hugging_face_source_reads_whole_passes_after_the_resumed_one() -> None:
    first = _chunked()
    it = iter(first)
    before = [i for _ in range(3) for i in next(it)[0]["id"].tolist()]
    again = _chunked()
    again.load_state_dict(first.state_dict())
    assert sorted(before + _pass(again)) == list(range(40)), "the resumed pass: every row once"
    assert sorted(_pass(again)) == list(range(40)), "the pass after a resume starts at the start"
    state = again.state_dict()
    third = _chunked()
    third.load_state_dict(state)  # the end of pass 1: nothing of it is left, then pass 2 whole
    assert _pass(third) == []
    assert sorted(_pass(third)) == list(range(40))
