"""Layout: taken from the first chunk, checked against every later one, serialised to JSON for the metadata."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dtypes import NUMPY_DTYPES, TORCH_DTYPES, random_tensor

from gigashuffle import INDEX_KEY, GigashuffleError, SchemaError
from gigashuffle.schema import FieldSpec, Layout


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("row_shape", [(), (3,), (2, 5)], ids=lambda s: f"row{list(s)}")
def test_torch_dtype_round_trip(dtype: torch.dtype, row_shape: tuple[int, ...]) -> None:
    t = random_tensor(dtype, (7, *row_shape))
    layout = Layout.from_chunk([{"x": t}])
    (spec,) = layout.fields
    assert spec == FieldSpec(0, "x", dtype, row_shape)
    assert spec.row_bytes == layout.row_bytes == int(np.prod(row_shape)) * dtype.itemsize
    rows, fields = layout.rows_in([{"x": t}])
    assert rows == 7
    (raw,) = fields
    assert raw.dtype == torch.uint8
    assert tuple(raw.shape) == (7, spec.row_bytes)
    assert raw.numpy().tobytes() == as_bytes(t)
    # Row i of the byte view is row i of the field.
    assert raw[4].numpy().tobytes() == as_bytes(t[4])
    again = Layout.from_json(layout.to_json())
    assert again == layout
    assert again.to_json() == layout.to_json()


@pytest.mark.parametrize("np_dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_dtype_round_trip(np_dtype: type) -> None:
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, size=5 * 4 * np.dtype(np_dtype).itemsize, dtype=np.uint8).view(np_dtype)
    if np_dtype is np.bool_:
        arr = rng.integers(0, 2, size=20).astype(np.bool_)
    arr = arr.reshape(5, 4)
    layout = Layout.from_chunk([{"x": arr}])
    (spec,) = layout.fields
    assert spec.dtype == torch.from_numpy(arr).dtype
    assert spec.shape == (4,)
    rows, (raw,) = layout.rows_in([{"x": arr}])
    assert rows == 5
    assert raw.numpy().tobytes() == arr.tobytes()
    assert Layout.from_json(layout.to_json()) == layout
    # The same data as a torch tensor has the same layout: numpy and torch chunks may be mixed.
    assert Layout.from_chunk([{"x": torch.from_numpy(arr)}]) == layout


def test_non_contiguous_fields_are_copied_in_row_order() -> None:
    base = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    strided = base.t()  # (6, 4), not contiguous
    np_strided = np.arange(40, dtype=np.float64).reshape(10, 4)[::2]  # (5, 4), every other row
    chunk = [{"t": strided[:5], "n": np_strided}]
    layout = Layout.from_chunk(chunk)
    rows, (t_raw, n_raw) = layout.rows_in(chunk)
    assert rows == 5
    assert t_raw.view(torch.int32).reshape(5, 4).tolist() == strided[:5].tolist()
    assert n_raw.numpy().view(np.float64).reshape(5, 4).tolist() == np_strided.tolist()


def test_multi_group_chunk() -> None:
    chunk = [
        {"tokens": random_tensor(torch.int64, (6, 16)), "mask": random_tensor(torch.bool, (6, 16))},
        {"image": random_tensor(torch.bfloat16, (6, 3, 2, 2)), "label": np.arange(6, dtype=np.int16)},
    ]
    layout = Layout.from_chunk(chunk)
    assert layout.num_groups == 2
    assert [(f.group, f.key, f.dtype, f.shape) for f in layout.fields] == [
        (0, "tokens", torch.int64, (16,)),
        (0, "mask", torch.bool, (16,)),
        (1, "image", torch.bfloat16, (3, 2, 2)),
        (1, "label", torch.int16, ()),
    ]
    assert layout.row_bytes == 16 * 8 + 16 + 12 * 2 + 2
    assert "chunk[1]['image']: bfloat16[3, 2, 2]" in layout.describe()
    assert Layout.from_json(layout.to_json()) == layout

    # A later chunk may list its keys in another order; bytes come back in the layout's field order.
    later = [
        {"mask": random_tensor(torch.bool, (3, 16), 1), "tokens": random_tensor(torch.int64, (3, 16), 2)},
        {"label": np.arange(3, dtype=np.int16), "image": random_tensor(torch.bfloat16, (3, 3, 2, 2), 3)},
    ]
    rows, fields = layout.rows_in(later)
    assert rows == 3
    expected = [later[0]["tokens"], later[0]["mask"], later[1]["image"], torch.from_numpy(later[1]["label"])]
    assert [f.numpy().tobytes() for f in fields] == [as_bytes(t) for t in expected]


def test_zero_row_chunk_is_accepted() -> None:
    layout = Layout.from_chunk([{"x": torch.zeros(4, 2)}])
    rows, (raw,) = layout.rows_in([{"x": torch.zeros(0, 2)}])
    assert rows == 0
    assert tuple(raw.shape) == (0, 8)


def test_tuple_chunk_is_accepted() -> None:
    chunk = ({"x": torch.ones(2, 2)},)
    assert Layout.from_chunk(chunk).rows_in(chunk)[0] == 2


def test_schema_error_is_a_value_error_and_a_gigashuffle_error() -> None:
    assert issubclass(SchemaError, ValueError)
    assert issubclass(SchemaError, GigashuffleError)


# -- errors in the first chunk ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("chunk", "fragments"),
    [
        ([{"a": torch.zeros(4), "b": torch.zeros(5)}], ["chunk[0]['b']", "5 rows", "have 4", "first dimension"]),
        (
            [{"a": torch.zeros(4, 2)}, {"c": np.zeros((3, 1), dtype=np.float32)}],
            ["chunk[1]['c']", "3 rows", "have 4"],
        ),
        ([{"a": [1, 2, 3]}], ["chunk[0]['a']", "is a list", "torch.Tensor or ndarray"]),
        ([{"a": torch.zeros(3), "s": "text"}], ["chunk[0]['s']", "is a str"]),
        ([{"z": torch.zeros(3, dtype=torch.complex64)}], ["chunk[0]['z']", "complex64", "two float fields"]),
        ([{"z": np.zeros(3, dtype=np.complex128)}], ["chunk[0]['z']", "numpy dtype complex128", "bool, integer"]),
        ([{"o": np.array([object(), object()])}], ["chunk[0]['o']", "numpy dtype object"]),
        ([{"u": np.array(["ab", "cd"])}], ["chunk[0]['u']", "numpy dtype <U2", "token ids"]),
        ([{"b": np.array([b"ab", b"cd"])}], ["chunk[0]['b']", "numpy dtype |S2", "uint8"]),
        ([{"d": np.zeros(3, dtype="datetime64[s]")}], ["chunk[0]['d']", "datetime64"]),
        ([{"q": np.zeros((3, 2), dtype=np.longdouble)}], ["chunk[0]['q']", "float128", ".astype()"]),
        ([{"e": np.zeros((3, 2), dtype=">i4")}], ["chunk[0]['e']", ">i4", "native-endian"]),
        ([{"x": torch.zeros(2), "s": torch.tensor(3.0)}], ["chunk[0]['s']", "0-d tensor", "row"]),
        ([{"s": np.float32(1.0)}], ["chunk[0]['s']", "float32"]),
        ([{"m": torch.zeros(3, device="meta")}], ["chunk[0]['m']", "lives on meta", "CPU tensors"]),
        ([{INDEX_KEY: torch.zeros(3)}], ["chunk[0]", repr(INDEX_KEY), "reserved", "rename"]),
        ([], ["non-empty list", "got list"]),
        ((), ["non-empty list", "got tuple"]),
        ({"a": torch.zeros(3)}, ["non-empty list", "got dict"]),
        (torch.zeros(3), ["non-empty list", "got Tensor"]),
        ([{"a": torch.zeros(3)}, torch.zeros(3)], ["chunk[1]", "non-empty dict", "got Tensor"]),
        ([[torch.zeros(3)]], ["chunk[0]", "non-empty dict", "got list"]),
        ([{}], ["chunk[0]", "non-empty dict"]),
        ([{1: torch.zeros(3)}], ["chunk[0]", "key 1", "must be str"]),
    ],
    ids=lambda v: None if not isinstance(v, list) or not v or not isinstance(v[0], str) else v[0][:30],
)
def test_bad_first_chunk_is_refused(chunk: object, fragments: list[str]) -> None:
    with pytest.raises(SchemaError) as info:
        Layout.from_chunk(chunk)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_index_key_is_reserved_in_later_chunks_too() -> None:
    layout = Layout.from_chunk([{"a": torch.zeros(3)}])
    with pytest.raises(SchemaError, match="reserved key"):
        layout.rows_in([{"a": torch.zeros(3), INDEX_KEY: torch.zeros(3)}])


# -- later chunks that break the first chunk's layout -----------------------------------------------------------
FIRST = [{"a": torch.zeros(4, 3), "b": torch.zeros(4, dtype=torch.int64)}, {"c": torch.zeros(4, 2, 2)}]


@pytest.mark.parametrize(
    ("chunk", "fragments"),
    [
        (
            [{"a": torch.zeros(4, 3), "x": torch.zeros(4, dtype=torch.int64)}, {"c": torch.zeros(4, 2, 2)}],
            ["fields differ", "expected [['a', 'b'], ['c']]", "got [['a', 'x'], ['c']]"],
        ),
        (
            [{"a": torch.zeros(4, 3)}, {"c": torch.zeros(4, 2, 2)}],
            ["fields differ", "got [['a'], ['c']]"],
        ),
        (
            [{"a": torch.zeros(4, 3), "b": torch.zeros(4, dtype=torch.int64)}],
            ["fields differ", "got [['a', 'b']]"],
        ),
        (
            [
                {"a": torch.zeros(4, 3, dtype=torch.float64), "b": torch.zeros(4, dtype=torch.int64)},
                {"c": torch.zeros(4, 2, 2)},
            ],
            ["chunk[0]['a'] changed layout", "float32[3]", "float64[3]", "dtype and row shape"],
        ),
        (
            [{"a": torch.zeros(4, 3), "b": torch.zeros(4, dtype=torch.int64)}, {"c": torch.zeros(4, 4)}],
            ["chunk[1]['c'] changed layout", "float32[2, 2]", "float32[4]"],
        ),
        (
            [{"a": torch.zeros(4, 3), "b": torch.zeros(4, 1, dtype=torch.int64)}, {"c": torch.zeros(4, 2, 2)}],
            ["chunk[0]['b'] changed layout", "int64[]", "int64[1]"],
        ),
        (
            [{"a": torch.zeros(4, 3), "b": torch.zeros(4, dtype=torch.int64)}, {"c": torch.zeros(5, 2, 2)}],
            ["chunk[1]['c'] has 5 rows", "have 4"],
        ),
        (
            [{"a": torch.zeros(4, 3), "b": np.zeros(4, dtype=np.int32)}, {"c": torch.zeros(4, 2, 2)}],
            ["chunk[0]['b'] changed layout", "int64[]", "int32[]"],
        ),
        (
            [{"a": torch.zeros(4, 3), "b": (1, 2, 3, 4)}, {"c": torch.zeros(4, 2, 2)}],
            ["chunk[0]['b'] is a tuple"],
        ),
    ],
)
def test_later_chunk_that_breaks_the_layout_is_refused(chunk: object, fragments: list[str]) -> None:
    layout = Layout.from_chunk(FIRST)
    with pytest.raises(SchemaError) as info:
        layout.rows_in(chunk)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_layout_json_is_compact_and_stable() -> None:
    layout = Layout.from_chunk(FIRST)
    assert layout.to_json() == (
        '{"num_groups":2,"fields":[[0,"a","float32",[3]],[0,"b","int64",[]],[1,"c","float32",[2,2]]]}'
    )


def test_layout_json_with_an_unknown_dtype_is_refused() -> None:
    text = Layout.from_chunk([{"a": torch.zeros(2)}]).to_json().replace("float32", "complex64")
    with pytest.raises(SchemaError, match="'complex64'"):
        Layout.from_json(text)


def test_equal_layouts_compare_equal_and_differ_by_any_field() -> None:
    a = Layout.from_chunk([{"x": torch.zeros(2, 3)}])
    assert a == Layout.from_chunk([{"x": torch.ones(9, 3)}])
    assert a != Layout.from_chunk([{"y": torch.zeros(2, 3)}])
    assert a != Layout.from_chunk([{"x": torch.zeros(2, 3, dtype=torch.float16)}])
    assert a != Layout.from_chunk([{"x": torch.zeros(2, 4)}])
    assert a != Layout.from_chunk([{"x": torch.zeros(2, 3)}, {"x": torch.zeros(2, 3)}])
