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

from gigashuffle.schema import Layout

_ALIGN = 64  # cache line: keeps every field region aligned for any dtype and for vectorised copies


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


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


def _field_offsets(layout: Layout, rows: int) -> tuple[list[int], int]:
    offsets, total = [], 0
    for spec in layout.fields:
        offsets.append(total)
        total += _align(rows * spec.row_bytes)
    return offsets, total
