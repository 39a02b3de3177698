"""``sources.Sharded``: every row once per pass, and cursors that merge and re-split over any number of writers
(NOTE [ Shard cursor ] in gigashuffle/sources/shardcursor.py), with real shard files for the ready-made readers."""

from __future__ import annotations

import collections
import itertools
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
from gigashuffle.sources import NpyReader, ParquetReader, PtReader, Sharded
from gigashuffle.sources.shardcursor import FORMAT_1, PIECES, fresh, owners, pieces, to_state

STRIDE = 1000


def _ids_reader(path: str) -> tuple[int, object]:
    """A shard named ``"<index>:<rows>"`` whose row ``i`` has id ``index * STRIDE + i`` (no file needed)."""
    index, length = (int(v) for v in path.split(":"))

    def read(start: int, stop: int) -> list[dict[str, torch.Tensor]]:
        return [{"id": torch.arange(start, stop) + index * STRIDE}]

    return length, read


def _source(lengths: list[int], rows: int, seed: int = 0) -> Sharded:
    return Sharded([f"{i}:{n}" for i, n in enumerate(lengths)], _ids_reader, rows, seed=seed, pass_field="pass")  # type: ignore[arg-type]


def _state(lengths: list[int], writer: int, writers: int) -> dict[str, object]:
    """Writer ``writer`` of ``writers`` at the start of pass 0, as its first ``state_dict()`` would say."""
    layout = pieces(lengths)
    return to_state(fresh(owners(layout, writers), writer), lengths, len(lengths), writer, writers)


def _share(lengths: list[int], state: dict[str, object]) -> int:
    layout = pieces(lengths)
    return sum(layout[p][2] - layout[p][1] for p, _pass, _rows in state["cursor"])  # type: ignore[attr-defined]


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
    counted: list[tuple[int, int]] = []
    states, skips = [], []
    for g in range(old):
        writer = _writer(lengths, rows, _state(lengths, g, old))
        share = _share(lengths, _state(lengths, g, old))
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
    owner = owners(pieces(lengths), new)
    for g, state in enumerate(resplit):
        assert {s for s, _p, _r in state["cursor"]} == {p for p, o in enumerate(owner) if o == g}, "piece owners"
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
        source.load_state_dict(_state([3, 4, 5], 0, 1))
    with pytest.raises(CheckpointError, match=r"gigashuffle\.Sharded/2"):
        source.load_state_dict({"pos": 3})
    with pytest.raises(CheckpointError, match=r"lengths differ from the state's .*\[\(1, 8, 4\)\]"):
        source.load_state_dict(_state([3, 8], 0, 1))
    with pytest.raises(CheckpointError, match="state 1 is writer 0's of 2"):
        source.reshard_states([_state([3, 4], 0, 2)] * 2, [0, 0], 3)
    with pytest.raises(CheckpointError, match=r"pieces \[3, 4, 5, 6\] are in no writer's state"):
        source.reshard_states([_state([3, 4], 0, 2), to_state({}, [3, 4], 2, 1, 2)], [0, 0], 3)
    with pytest.raises(CheckpointError, match="past the end"):
        _source([0, 0], rows=2).reshard_states([_state([0, 0], 0, 1)], [5], 2)
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


def _lockstep_rows_per_shard(lengths: list[int], writers: int, chunks: int, balance: bool = True) -> list[int]:
    """Rows each shard delivered when ``writers`` writers read ``chunks`` chunks each, in lockstep (writers read at
    one rate): counted, not timed."""
    streams = []
    for g in range(writers):
        source = Sharded([f"{i}:{n}" for i, n in enumerate(lengths)], _ids_reader, 4, pass_field="pass",  # type: ignore[arg-type]
                         balance=balance)  # fmt: skip
        layout = source._layout()
        one = to_state(fresh([0] * len(layout), 0), source._shard_lengths(), len(lengths), 0, 1)
        source.load_state_dict(source.reshard_states([one], [0], writers)[g])
        streams.append(_chunks(source))
    per_shard = [0] * len(lengths)
    for _ in range(chunks):
        for stream in streams:
            for row_id, _pass in next(stream):
                per_shard[row_id // STRIDE] += 1
    return per_shard


def test_shards_of_1x_and_3x_rows_are_read_at_one_rate_per_row() -> None:
    """Issue 35: shards dealt out by count read a writer's small shard three times as often per row as another's
    large one; pieces dealt out by rows read every row at one rate (NOTE [ Balanced pieces ])."""
    lengths = [200, 600]  # 1x and 3x rows; 2 writers of 400 rows a pass each read 4 passes of 4-row chunks
    rates = [n / length for n, length in zip(_lockstep_rows_per_shard(lengths, 2, 400), lengths, strict=True)]
    assert max(rates) <= 1.1 * min(rates), f"rows read per row of each shard: {rates}"
    skewed = [n / length for n, length in zip(_lockstep_rows_per_shard(lengths, 2, 400, False), lengths, strict=True)]
    assert max(skewed) >= 2.5 * min(skewed), f"balance=False deals whole shards: {skewed}"
    # Six shards of uneven lengths over four writers (the case): within 10% over a few passes too.
    lengths = [270, 330, 570, 640, 260, 320]
    counts = _lockstep_rows_per_shard(lengths, 4, 4 * sum(lengths) // 16)
    rates = [n / length for n, length in zip(counts, lengths, strict=True)]
    assert max(rates) <= 1.1 * min(rates), f"rows read per row of each shard: {rates}"


def test_the_piece_layout_depends_on_the_shards_only_and_stays_small() -> None:
    assert pieces([2, 0, 5]) == [(0, 0, 1), (0, 1, 2), (1, 0, 0), *((2, i, i + 1) for i in range(5))]
    for lengths in ([4096, 2048], [1, 10**9, 5], [7] * 3000):
        layout = pieces(lengths)
        assert len(layout) <= PIECES + len(lengths), "at most PIECES pieces and one per shard more"
        assert max(e - a for _s, a, e in layout) <= -(-sum(lengths) // PIECES)
        ends = {s: 0 for s in range(len(lengths))}
        for s, a, e in layout:
            assert a == ends[s] and e > a, "each shard cut into consecutive ranges"
            ends[s] = e
        assert list(ends.values()) == lengths
    for writers in range(1, 9):
        layout = pieces([100, 300, 250, 7])
        share = [0] * writers
        for (_s, start, stop), g in zip(layout, owners(layout, writers), strict=True):
            share[g] += stop - start
        biggest = max(stop - start for _s, start, stop in layout)
        assert max(share) - min(share) <= biggest, (writers, share)


def test_a_state_of_the_whole_shard_format_loads_with_balance_false() -> None:
    old = {"format": FORMAT_1, "num_shards": 2, "writer": 0, "writers": 1, "cursor": [[0, 0, 3], [1, 0, 0]]}
    with pytest.raises(CheckpointError, match=r"resume it with Sharded\(\.\.\., balance=False\)"):
        _source([5, 9], rows=2).load_state_dict(old)
    whole = Sharded(["0:5", "1:9"], _ids_reader, 2, pass_field="pass", balance=False)  # type: ignore[arg-type]
    whole.load_state_dict(old)
    assert sorted(i for i, _p in _rows_of_pass(whole, 0)) == [3, 4, *range(STRIDE, STRIDE + 9)]


def _rows_of_pass(source: Sharded, pass_: int) -> list[tuple[int, int]]:
    return [row for row in itertools.takewhile(lambda r: r[1] == pass_, _rows(source))]
