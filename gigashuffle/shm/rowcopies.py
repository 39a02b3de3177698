"""Where each field's rows lie in a region of shared memory, and the form both copies move them in.

Each field is stored as raw bytes, ``uint8 [rows, row_bytes]``, so writing a chunk and gathering a batch are one
vectorized copy per field for every dtype (bfloat16, bool and float8 included).

NOTE [ Row copies ]
Both copies see a field as a 1-D numpy array with one element per row (``row_elements``): the unsigned integer of
the row's size for rows of 1, 2, 4 or 8 bytes, else a ``void`` scalar of ``row_bytes``, which numpy moves as one
block. A write is then ``put`` of the chunk's rows into the slot ids, a gather ``take`` of the slot ids into a
ring slot. One element per row is what makes them cheap: a fancy assignment into a ``[slots, row_bytes // 8]``
int64 view walks an index iterator over every 8-byte word, and torch's ``index_select`` pays its dispatch and a
per-row loop. Measured on the 2-core VM of docs/benchmarks.md (1,024 random rows, medians of 5): a write of
64-byte rows 9.5 -> 2.6 us, of 32-byte rows 15.6 -> 2.8 us; a gather of 64-byte rows 4.7 -> 3.4 us, of 8-byte rows
7.2 -> 3.8 us; 150 KB rows cost the same either way (the copy is the memory traffic). ``take`` runs with
``mode="clip"``: with ``"raise"`` numpy gathers into a temporary and copies it again (3x the time on 8 KB rows),
so the gather checks the ids' range itself, which costs one ``min`` and one ``max`` over the ids (a reader skips
it for the ids its own slot table drew, which are rows of this buffer by construction).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from gigashuffle.schema import Layout

_ALIGN = 64  # cache line: keeps every field region aligned for any dtype and for vectorised copies


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


RowElements = npt.NDArray[Any]
"""A field's rows as a 1-D array of whole-row elements (NOTE [ Row copies ])."""

_ROW_INTS: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


def row_elements(rows: npt.NDArray[np.uint8]) -> npt.NDArray[Any]:
    """``rows`` (``uint8 [n, row_bytes]``) as a 1-D array of ``n`` elements, each one whole row, sharing memory:
    NOTE [ Row copies ]."""
    n, row_bytes = rows.shape
    if rows.strides[1] != 1 and row_bytes > 1:
        raise ValueError(f"a field's rows must be contiguous bytes, got strides {rows.strides}")
    dtype: np.dtype[Any] = _ROW_INTS.get(row_bytes) or np.dtype((np.void, row_bytes))
    elements: npt.NDArray[Any] = rows.view(dtype).reshape(n)
    return elements


def numpy_dtype(dtype: torch.dtype) -> np.dtype[Any] | None:
    """The numpy dtype a tensor of ``dtype`` shows as, or None where numpy has none (bfloat16, float8)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None


# What a tensor of a dtype without a numpy twin is viewed as before ``.numpy()``: the integer of its size.
_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ChunkRows:
    """A writer's chunks as row elements (NOTE [ Row copies ]), checked exactly as ``Layout.rows_in`` checks them.

    A chunk of the common shape (the layout's groups and keys, each field a contiguous CPU tensor of the layout's
    dtype and row shape, none requiring grad, at least one row) is checked and cut in one pass of attribute reads
    and two numpy views per field; any other chunk goes through ``rows_in``, which converts what it can and raises
    the error that names the field. Per chunk, through ``rows_in`` and ``row_elements`` against here (timeit medians
    on the 2-core VM): tiny's 1,024 rows of 16 float32 + one int64 10.5 -> 4.3 us (a writer spends about 60 us of
    CPU per such chunk), 256 token rows 6.2 -> 2.6, 64 images + labels 11.0 -> 4.6 (docs/benchmarks.md).
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._keys = [frozenset(f.key for f in layout.fields if f.group == g) for g in range(layout.num_groups)]
        # Per field: where it is; what it must be (dtype, row shape, dimensions); the dtype to view it as for numpy
        # (None: as it is); whether its rows have more than one dimension (flattened first); one row's element dtype.
        self._fields = [
            (f.group, f.key, f.dtype, f.shape, len(f.shape) + 1,
             None if numpy_dtype(f.dtype) is not None else _SAME_SIZE_INTS[f.dtype.itemsize], len(f.shape) > 1,
             _ROW_INTS.get(f.row_bytes) or np.dtype((np.void, f.row_bytes)))
            for f in layout.fields
        ]  # fmt: skip
        # Rows of no bytes have no element dtype worth the fast path: those layouts always take rows_in.
        self._fast = all(f.row_bytes for f in layout.fields)

    def __call__(self, chunk: object) -> tuple[int, list[RowElements]]:
        """The chunk's row count and, per field of the layout, its rows as a 1-D array of row elements (views of
        the chunk's memory: copy them before the dataset reuses it)."""
        found = self._cut(chunk) if self._fast else None
        if found is not None:
            return found
        rows, as_bytes = self.layout.rows_in(chunk)
        if not rows:  # no bytes to view as rows (a chunk of no rows copies nothing)
            return 0, [np.empty(0, dtype=field[-1]) for field in self._fields]
        return rows, [row_elements(f.numpy()) for f in as_bytes]

    def _cut(self, chunk: object) -> tuple[int, list[RowElements]] | None:
        if type(chunk) is not list and type(chunk) is not tuple:
            return None
        if len(chunk) != len(self._keys):
            return None
        for group, keys in zip(chunk, self._keys, strict=True):  # lengths checked above
            if type(group) is not dict or group.keys() != keys:
                return None
        rows = -1
        elements = []
        for g, key, dtype, shape, ndim, view_as, flatten, row_dtype in self._fields:
            tensor = chunk[g][key]
            if (
                type(tensor) is not torch.Tensor
                or tensor.dtype is not dtype
                or tensor.requires_grad
                or not tensor.is_cpu
                or not tensor.is_contiguous()
            ):
                return None
            size = tensor.shape
            if len(size) != ndim or size[1:] != shape or (rows >= 0 and size[0] != rows) or not size[0]:
                return None
            rows = size[0]
            array = (tensor if view_as is None else tensor.view(view_as)).numpy()
            if flatten:
                array = array.reshape(rows, -1)
            # [n] -> [n] of a same-size dtype, or [n, k] -> [n, 1] -> [n]: views, in about 0.3 us each
            elements.append(array.view(row_dtype).ravel())
        return rows, elements


def _field_offsets(layout: Layout, rows: int) -> tuple[list[int], int]:
    offsets, total = [], 0
    for spec in layout.fields:
        offsets.append(total)
        total += _align(rows * spec.row_bytes)
    return offsets, total
