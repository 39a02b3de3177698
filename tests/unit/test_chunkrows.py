"""ChunkRows: the writer's one-pass check and cut of a chunk gives exactly what rows_in and row_elements give, and
every chunk it does not vouch for takes rows_in's path (its conversions and its errors)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from dtypes import TORCH_DTYPES, random_tensor

from gigashuffle import SchemaError
from gigashuffle.schema import Layout
from gigashuffle.shm.rowcopies import ChunkRows, row_elements


def reference(layout: Layout, chunk: Any) -> tuple[int, list[np.ndarray]]:
    rows, as_bytes = layout.rows_in(chunk)
    return rows, [row_elements(f.numpy()) for f in as_bytes]


def assert_same(got: tuple[int, list[np.ndarray]], want: tuple[int, list[np.ndarray]]) -> None:
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1])
    for g, w in zip(got[1], want[1], strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape == (want[0],)
        assert g.tobytes() == w.tobytes()


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("row_shape", [(), (3,), (2, 5), (1,)], ids=lambda s: f"row{list(s)}")
def test_fast_cut_equals_rows_in(dtype: torch.dtype, row_shape: tuple[int, ...]) -> None:
    chunk = [{"a": random_tensor(dtype, (7, *row_shape)), "b": torch.arange(7)}, {"c": random_tensor(dtype, (7, 4))}]
    layout = Layout.from_chunk(chunk)
    cut = ChunkRows(layout)
    fast = cut._cut(chunk)
    assert fast is not None, "a chunk of the layout's own shape takes the fast path"
    assert_same(fast, reference(layout, chunk))
    for got, field in zip(fast[1], (chunk[0]["a"], chunk[0]["b"], chunk[1]["c"]), strict=True):
        assert np.shares_memory(got, field.view(torch.uint8).numpy()), "the cut is a view, never a copy"


def test_later_chunks_of_another_row_count_and_tuples() -> None:
    layout = Layout.from_chunk([{"x": torch.zeros(4, 3), "y": torch.zeros(4, dtype=torch.int64)}])
    cut = ChunkRows(layout)
    chunk = ({"y": torch.arange(9), "x": random_tensor(torch.float32, (9, 3))},)  # key order and a tuple: fine
    assert cut._cut(chunk) is not None
    assert_same(cut(chunk), reference(layout, chunk))


@pytest.mark.parametrize(
    "make",
    [lambda: torch.arange(5.0).reshape(1, 5).t(), lambda: torch.arange(6.0).reshape(2, 3).t()[:, 0:1]],
    ids=["transposed row", "a column of a transpose"],
)
def test_contiguous_with_an_odd_stride(make: Any) -> None:
    """A contiguous tensor whose last dimension has size 1 may have any stride there: both paths take it."""
    tensor = make()
    assert tensor.is_contiguous() and tensor.stride(-1) != 1
    layout = Layout.from_chunk([{"x": torch.zeros(2, 1)}])
    chunk = [{"x": tensor}]
    fast = ChunkRows(layout)._cut(chunk)
    assert fast is not None
    assert_same(fast, reference(layout, chunk))
    assert fast[1][0].tobytes() == tensor.contiguous().numpy().tobytes()


def _variants() -> list[tuple[str, Any]]:
    x, y = random_tensor(torch.float32, (6, 3)), torch.arange(6)
    return [
        ("numpy field", [{"x": x.numpy(), "y": y}]),
        ("non-contiguous field", [{"x": random_tensor(torch.float32, (3, 6)).t(), "y": y}]),
        ("field requiring grad", [{"x": x.clone().requires_grad_(), "y": y}]),
        ("a list of dicts in a list subclass", type("L", (list,), {})([{"x": x, "y": y}])),
    ]


@pytest.mark.parametrize(("what", "chunk"), _variants(), ids=[v[0] for v in _variants()])
def test_other_chunks_rows_in_converts(what: str, chunk: Any) -> None:
    layout = Layout.from_chunk([{"x": torch.zeros(2, 3), "y": torch.zeros(2, dtype=torch.int64)}])
    cut = ChunkRows(layout)
    assert cut._cut(chunk) is None, f"a {what} is rows_in's to convert"
    assert_same(cut(chunk), reference(layout, chunk))


def _bad() -> list[tuple[str, Any, str]]:
    x, y = torch.zeros(5, 3), torch.arange(5)
    return [
        ("wrong dtype", [{"x": x.double(), "y": y}], "changed layout"),
        ("wrong row shape", [{"x": torch.zeros(5, 4), "y": y}], "changed layout"),
        ("rows differ", [{"x": x, "y": torch.arange(4)}], "share its first dimension"),
        ("missing key", [{"x": x}], "differ from the first chunk's"),
        ("extra key", [{"x": x, "y": y, "z": y}], "differ from the first chunk's"),
        ("extra group", [{"x": x, "y": y}, {"z": y}], "differ from the first chunk's"),
        ("not a list", {"x": x, "y": y}, "non-empty list"),
        ("a 0-d field", [{"x": x, "y": torch.tensor(3)}], "0-d tensor"),
    ]


@pytest.mark.parametrize(("what", "chunk", "message"), _bad(), ids=[b[0] for b in _bad()])
def test_bad_chunks_raise_rows_ins_error(what: str, chunk: Any, message: str) -> None:
    layout = Layout.from_chunk([{"x": torch.zeros(2, 3), "y": torch.zeros(2, dtype=torch.int64)}])
    cut = ChunkRows(layout)
    assert cut._cut(chunk) is None, f"a chunk with a {what} is never cut"
    with pytest.raises(SchemaError, match=message) as caught:
        cut(chunk)
    with pytest.raises(SchemaError) as direct:
        layout.rows_in(chunk)
    assert str(caught.value) == str(direct.value)


def test_empty_chunk_takes_rows_in() -> None:
    layout = Layout.from_chunk([{"x": torch.zeros(2, 3)}])
    cut = ChunkRows(layout)
    chunk = [{"x": torch.zeros(0, 3)}]
    assert cut._cut(chunk) is None
    rows, (elements,) = cut(chunk)
    assert rows == layout.rows_in(chunk)[0] == 0
    assert elements.shape == (0,) and elements.dtype == np.dtype((np.void, 12))
