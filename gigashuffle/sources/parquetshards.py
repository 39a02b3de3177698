"""Parquet shards for ``Sharded``: :class:`ParquetReader` reads them with pyarrow, a row group at a time, into tensors.

NOTE [ Parquet list columns ]
A row field is a tensor of one shape for every row (the buffer's layout is fixed by the first chunk). Numeric and
boolean columns are one value per row. A list column becomes a field of shape ``(length,)`` (a list of lists
``(length, inner)``, and so on) when every row's list has the same length: pandas writes a column of equal-length
numpy arrays or Python lists as ``list<element: double>``, a variable-size list type, although every row has the
same length, so the type alone cannot tell; the lengths are checked on every chunk. A row whose list has another
length than the first row read of its shard, a null list and a null value are refused with a ``ValueError``
naming the column, the shard and the row (its index in the shard): a padded or truncated tensor would hand the
model rows that are not the data, and a null has no value in an int tensor. Fixed-size lists
(``pa.list_(pa.float32(), 4)``) are the same tensors, with the length in the type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

Chunk = list[dict[str, torch.Tensor]]
ReadRows = Callable[[int, int], Chunk]

_FIX = (
    "write the column with one length per row (docs/data-sources.md, 'Fixed-size list columns'), or leave it "
    "out with ParquetReader(columns=[...])"
)


class ParquetReader:
    """Reads parquet shards (pyarrow), a row group at a time: numeric and boolean columns, and list columns whose
    rows all hold one number of values (NOTE [ Parquet list columns ]), as tensors; ``columns`` picks the columns
    (default: all)."""

    def __init__(self, columns: Sequence[str] | None = None) -> None:
        self.columns = list(columns) if columns is not None else None

    def __call__(self, path: str) -> tuple[int, ReadRows]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        file = pq.ParquetFile(path)
        meta = file.metadata
        starts = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        cache: dict[int, Any] = {}
        # Per column, the row shape of the first chunk read from this shard and the row it was seen on: the row
        # a later chunk's different shape is compared with (a resumed cursor may start mid-shard).
        seen: dict[str, tuple[tuple[int, ...], int]] = {}

        def read(start: int, stop: int) -> Chunk:
            first = int(np.searchsorted(starts, start, side="right")) - 1
            last = int(np.searchsorted(starts, stop, side="left"))
            parts = []
            for g in range(first, last):
                if g not in cache:
                    cache.clear()  # one row group in memory at a time: a shard's chunks come in order
                    cache[g] = file.read_row_group(g, columns=self.columns)
                lo, hi = max(start, starts[g]) - starts[g], min(stop, starts[g + 1]) - starts[g]
                parts.append(cache[g].slice(int(lo), int(hi - lo)))
            table = pa.concat_tables(parts)
            chunk = {}
            for name in table.column_names:
                tensor = column_tensor(path, name, table.column(name), first_row=start)
                shape, row = seen.setdefault(name, (tuple(tensor.shape[1:]), start))
                if tuple(tensor.shape[1:]) != shape:
                    raise ValueError(
                        f"ParquetReader: column {name!r} of {path}: rows {start}..{stop - 1} have values of "
                        f"shape {tuple(tensor.shape[1:])} where row {row} has {shape}; {_FIX}"
                    )
                chunk[name] = tensor
            return [chunk]

        return int(meta.num_rows), read


def column_tensor(path: str, name: str, column: Any, first_row: int = 0) -> torch.Tensor:
    """A pyarrow column (``Array`` or ``ChunkedArray``) of numbers, or of lists of one length per row (nested
    too), as a tensor of shape ``(rows, *row shape)``; ``first_row`` is the shard's index of its first row, for
    the errors (NOTE [ Parquet list columns ])."""
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    rows = len(array)
    shape: list[int] = []
    level, per_row = array, 1  # the values of this nesting level; how many of them each row holds
    while _is_list(level.type):
        _refuse_nulls(path, name, level, first_row, per_row, "a null list")
        if pa.types.is_fixed_size_list(level.type):
            length = int(level.type.list_size)
        else:
            lengths = level.value_lengths().to_numpy(zero_copy_only=False)
            length = int(lengths[0]) if len(lengths) else 0
            if len(differ := np.flatnonzero(lengths != length)):
                at = int(differ[0])
                where = f" (nesting level {len(shape) + 1})" if shape else ""
                raise ValueError(
                    f"ParquetReader: column {name!r} of {path} is {array.type} with lists of different lengths"
                    f"{where}: row {first_row + at // per_row} has {_values(int(lengths[at]))} where row {first_row} "
                    f"has {length}; a list column is a tensor only when every row's list has one length: {_FIX}"
                )
        shape.append(length)
        per_row *= length
        level = level.flatten()
    if not (pa.types.is_integer(level.type) or pa.types.is_floating(level.type) or pa.types.is_boolean(level.type)):
        raise TypeError(
            f"ParquetReader: column {name!r} of {path} is {array.type}, which has no tensor form; pass "
            "columns=[...] naming only numeric columns and lists of numbers of one length per row"
        )
    _refuse_nulls(path, name, level, first_row, per_row, "a null value")
    values = np.array(level.to_numpy(zero_copy_only=False))  # a copy: arrow buffers are read-only
    return torch.from_numpy(values.reshape(rows, *shape))


def _values(n: int) -> str:
    return f"{n} value" if n == 1 else f"{n} values"


def _is_list(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))


def _refuse_nulls(path: str, name: str, level: Any, first_row: int, per_row: int, what: str) -> None:
    if not level.null_count:
        return
    at = int(np.flatnonzero(~np.asarray(level.is_valid().to_numpy(zero_copy_only=False)))[0])
    raise ValueError(
        f"ParquetReader: column {name!r} of {path} holds {what} in row {first_row + at // per_row}, which has no "
        f"tensor form; fill or drop the nulls when writing the shards, or leave the column out with "
        "ParquetReader(columns=[...])"
    )
