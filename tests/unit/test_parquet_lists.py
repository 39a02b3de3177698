"""``ParquetReader`` over list columns (NOTE [ Parquet list columns ] in gigashuffle/sources/parquetshards.py): a list
column whose rows all have one length is a tensor field, as pandas writes one; a row of another length, a null list
and a null value are refused naming the column, the shard and the row. Real parquet files, written by pandas and
pyarrow, read through ``Sharded`` as a writer reads them; and the docs' snippet for writing them, run verbatim."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gigashuffle.sources import ParquetReader, Sharded

DOCS = Path(__file__).parents[2] / "docs" / "data-sources.md"


def _rows(path: Path, rows: int, columns: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Every row of one shard, as a writer reads it (chunks of ``rows``), each field concatenated."""
    chunks = list(Sharded([str(path)], ParquetReader(columns), rows=rows))
    return {name: torch.cat([c[0][name] for c in chunks]) for name in chunks[0][0]}


def test_a_pandas_list_column_of_one_length_is_a_tensor_field(tmp_path: Path) -> None:
    features = [np.arange(4, dtype=np.float64) + 10 * i for i in range(23)]
    pd.DataFrame({"features": features, "label": np.arange(23)}).to_parquet(tmp_path / "a.parquet", row_group_size=5)
    assert str(pq.read_schema(tmp_path / "a.parquet").field("features").type) == "list<element: double>"
    rows = _rows(tmp_path / "a.parquet", rows=4)  # chunks across row groups
    assert rows["features"].dtype == torch.float64 and rows["features"].shape == (23, 4)
    assert torch.equal(rows["features"], torch.from_numpy(np.stack(features)))
    assert torch.equal(rows["label"], torch.arange(23))


def test_nested_large_and_fixed_size_lists_are_tensor_fields(tmp_path: Path) -> None:
    matrices = np.arange(10 * 2 * 3, dtype=np.int32).reshape(10, 2, 3)
    table = pa.table({
        "matrix": pa.array(matrices.tolist(), type=pa.list_(pa.list_(pa.int32()))),
        "large": pa.array([[i, -i] for i in range(10)], type=pa.large_list(pa.int64())),
        "fixed": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(30, dtype=np.float32)), 3),
        "flag": pa.array([i % 2 == 0 for i in range(10)]),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "n.parquet", row_group_size=3)
    rows = _rows(tmp_path / "n.parquet", rows=4)
    assert torch.equal(rows["matrix"], torch.from_numpy(matrices))
    assert torch.equal(rows["large"], torch.tensor([[i, -i] for i in range(10)]))
    assert torch.equal(rows["fixed"], torch.arange(30, dtype=torch.float32).reshape(10, 3))
    assert rows["flag"].dtype == torch.bool and rows["flag"].tolist() == [i % 2 == 0 for i in range(10)]


def _lists(lengths: list[int]) -> list[list[float]]:
    return [[float(i)] * n for i, n in enumerate(lengths)]


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        # within one chunk (rows 12..15), in the shard's fourth chunk: the row is named by its index in the shard
        ([4] * 13 + [3] + [4] * 6, "row 13 has 3 values where row 12 has 4"),
        # a whole chunk of another length than the first chunk read
        ([4] * 8 + [3] * 4, r"rows 8..11 have values of shape \(3,\) where row 0 has \(4,\)"),
        ([2, 2, 1], "row 2 has 1 value where row 0 has 2"),
    ],
)
def test_a_row_of_another_length_is_refused_naming_column_shard_and_row(
    tmp_path: Path, lengths: list[int], message: str
) -> None:
    path = tmp_path / "uneven.parquet"
    pd.DataFrame({"features": _lists(lengths)}).to_parquet(path, row_group_size=5)
    with pytest.raises(ValueError, match=message) as refused:
        _rows(path, rows=4)
    text = str(refused.value)
    assert f"column 'features' of {path}" in text, text  # the column and the shard
    assert "docs/data-sources.md" in text and "columns=[...]" in text, text  # the fixes


@pytest.mark.parametrize(
    ("column", "what", "row"),
    [
        (pa.array([[1.0, 2.0]] * 6 + [None] + [[1.0, 2.0]], type=pa.list_(pa.float64())), "a null list", 6),
        (pa.array([[1, 2]] * 5 + [[1, None]] + [[1, 2]] * 2, type=pa.list_(pa.int64())), "a null value", 5),
        (pa.array([1, 2, 3, 4, 5, None, 7, 8], type=pa.int64()), "a null value", 5),
    ],
)
def test_nulls_are_refused_naming_the_row(tmp_path: Path, column: pa.Array, what: str, row: int) -> None:
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"v": column}), path)
    with pytest.raises(ValueError, match=f"column 'v' of {re.escape(str(path))} holds {what} in row {row},"):
        _rows(path, rows=4)


def test_a_list_of_strings_has_no_tensor_form(tmp_path: Path) -> None:
    path = tmp_path / "words.parquet"
    pq.write_table(pa.table({"words": pa.array([["a", "b"], ["c", "d"]])}), path)
    with pytest.raises(TypeError, match=r"column 'words' .* is list<element: string>, which has no tensor form"):
        _rows(path, rows=2)


def test_the_docs_snippet_writes_shards_the_reader_takes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    section = DOCS.read_text().split("### Fixed-size list columns (parquet)", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, str(DOCS), "exec"), {})  # verbatim; it asserts the shape it promises
    assert sorted(os.listdir(tmp_path)) == ["train-0.parquet", "train-1.parquet"]
    rows = _rows(tmp_path / "train-0.parquet", rows=256)
    assert rows["features"].shape == (1000, 4) and rows["features"].dtype == torch.float64
    rows = _rows(tmp_path / "train-1.parquet", rows=256, columns=["features"])
    assert rows["features"].shape == (1000, 4) and rows["features"].dtype == torch.float32
