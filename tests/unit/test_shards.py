"""``sources.Sharded``: every row once per pass, and cursors that merge and re-split over any number of writers
(NOTE [ Shard cursor ] in gigashuffle/shardcursor.py), with real shard files for the ready-made readers."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gigashuffle import CheckpointError
from gigashuffle.shardcursor import fresh, to_state
from gigashuffle.sources import NpyReader, ParquetReader, PtReader, Sharded

STRIDE = 1000


def _ids_reader(path: str) -> tuple[int, object]:
    """A shard named ``"<index>:<rows>"`` whose row ``i`` has id ``index * STRIDE + i`` (no file needed)."""
    index, length = (int(v) for v in path.split(":"))

    def read(start: int, stop: int) -> list[dict[str, torch.Tensor]]:
        return [{"id": torch.arange(start, stop) + index * STRIDE}]

    return length, read


def _source(lengths: list[int], rows: int, seed: int = 0) -> Sharded:
    return Sharded([f"{i}:{n}" for i, n in enumerate(lengths)], _ids_reader, rows, seed=seed, pass_field="pass")  # type: ignore[arg-type]


def _writer(lengths: list[int], rows: int, state: dict[str, object]) -> Sharded:
    source = _source(lengths, rows)
    source.load_state_dict(state)
    return source


def _chunks(source: Sharded) -> Iterator[list[tuple[int, int]]]:
    """The (id, pass) rows of each chunk of ``source`` from its state on, pass after pass, as a writer reads."""
    while True:
        chunks = 0
        for chunk in source:
            chunks += 1
            yield list(zip(chunk[0]["id"].tolist(), chunk[0]["pass"].tolist(), strict=True))
        if chunks == 0:
            return  # an empty share (no shard, or only empty ones): every pass is empty


def _rows(source: Sharded) -> Iterator[tuple[int, int]]:
    for chunk in _chunks(source):
        yield from chunk


def _every(lengths: list[int]) -> set[int]:
    return {i * STRIDE + r for i, n in enumerate(lengths) for r in range(n)}


def test_one_writer_reads_every_row_once_per_pass_and_the_pass_is_in_the_state() -> None:
    lengths = [5, 0, 17, 3]
    source = _source(lengths, rows=4)
    first = [(i, p) for chunk in source for i, p in zip(chunk[0]["id"].tolist(), chunk[0]["pass"].tolist())]
    assert sorted(i for i, _ in first) == sorted(_every(lengths)) and {p for _, p in first} == {0}
    assert {p for _s, p, _r in source.state_dict()["cursor"]} == {1}, "the end of pass 0 is the start of pass 1"
    second = [i for chunk in source for i in chunk[0]["id"].tolist()]
    assert sorted(second) == sorted(first_ids := [i for i, _ in first]) and second != first_ids, "shard order"


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=7),
    rows=st.integers(1, 5),
    old=st.integers(1, 5),
    new=st.integers(1, 5),
    data=st.data(),
)
def test_cursors_of_any_writers_resplit_over_any_other_number_exactly(
    lengths: list[int], rows: int, old: int, new: int, data: st.DataObject
) -> None:
    """Old writers read some rows (into the next pass, maybe), checkpoint, write ``skip`` rows more; the states
    re-split over ``new`` writers, which read on: passes 0 and 1 each hold every row exactly once."""
    n = len(lengths)
    counted: list[tuple[int, int]] = []
    states, skips = [], []
    for g in range(old):
        writer = _writer(lengths, rows, to_state(fresh(n, g, old), n, g, old))
        share = sum(lengths[s] for s in range(g, n, old))
        chunks = _chunks(writer)
        before = data.draw(st.integers(0, 2 * share // rows + 2), label=f"chunks before writer {g}'s checkpoint")
        for _ in range(before if share else 0):
            counted += next(chunks)
        states.append(writer.state_dict())  # between two chunks, as the writer asks
        skip = data.draw(st.integers(0, share), label=f"writer {g}'s skip") if share else 0
        after = _rows(_writer(lengths, rows, states[-1]))
        counted += [next(after) for _ in range(skip)]  # rows written after the state: counted already
        skips.append(skip)
    resplit = _source(lengths, rows).reshard_states(states, skips, new)
    assert [(s["writer"], s["writers"]) for s in resplit] == [(g, new) for g in range(new)]
    for g, state in enumerate(resplit):
        assert {s for s, _p, _r in state["cursor"]} == set(range(g, n, new)), "shard s goes to writer s % new"
        for row in _rows(_writer(lengths, rows, state)):
            if row[1] > 1:
                break
            counted.append(row)
    for pass_ in (0, 1):
        seen = collections.Counter(i for i, p in counted if p == pass_)
        assert set(seen) == _every(lengths), f"pass {pass_}: lost {sorted(_every(lengths) - set(seen))[:5]}"
        assert max(seen.values(), default=1) == 1, f"pass {pass_}: twice {[i for i, c in seen.items() if c > 1]}"


def test_bad_states_are_refused_with_what_differs() -> None:
    source = _source([3, 4], rows=2)
    with pytest.raises(CheckpointError, match="source of 3 shards but this one has 2"):
        source.load_state_dict(to_state(fresh(3, 0, 1), 3, 0, 1))
    with pytest.raises(CheckpointError, match=r"gigashuffle\.Sharded/1"):
        source.load_state_dict({"pos": 3})
    with pytest.raises(CheckpointError, match="state 1 is writer 0's of 2"):
        source.reshard_states([to_state(fresh(2, 0, 2), 2, 0, 2)] * 2, [0, 0], 3)
    with pytest.raises(CheckpointError, match=r"shards \[1\] are in no writer's state"):
        source.reshard_states([to_state(fresh(2, 0, 2), 2, 0, 2), to_state({}, 2, 1, 2)], [0, 0], 3)
    with pytest.raises(CheckpointError, match="past the end"):
        _source([0, 0], rows=2).reshard_states([to_state(fresh(2, 0, 1), 2, 0, 1)], [5], 2)
    with pytest.raises(ValueError, match="rows=0"):
        Sharded(["a"], _ids_reader, rows=0)  # type: ignore[arg-type]


def test_ready_made_readers_read_real_files(tmp_path: Path) -> None:
    ids = np.arange(23, dtype=np.int64)
    vec = np.stack([ids, -ids], axis=1).astype(np.float32)
    table = pa.table({"id": ids, "vec": pa.FixedSizeListArray.from_arrays(pa.array(vec.reshape(-1)), 2)})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=5)
    np.save(tmp_path / "a.npy", vec)
    torch.save({"id": torch.from_numpy(ids), "vec": torch.from_numpy(vec)}, tmp_path / "a.pt")
    for name, reader in (("a.parquet", ParquetReader()), ("a.npy", NpyReader("vec")), ("a.pt", PtReader())):
        chunks = list(Sharded([tmp_path / name], reader, rows=4))
        assert [len(c[0]["vec"]) for c in chunks] == [4] * 5 + [3], name
        assert torch.equal(torch.cat([c[0]["vec"] for c in chunks]), torch.from_numpy(vec)), name
    with pytest.raises(TypeError, match=r"column .name. .* has no tensor form"):
        pq.write_table(pa.table({"name": ["x"]}), tmp_path / "s.parquet")
        list(Sharded([tmp_path / "s.parquet"], ParquetReader(), rows=4))
