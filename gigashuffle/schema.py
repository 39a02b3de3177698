"""The row layout of a loader, taken from the dataset's first chunk, and the checks of every later chunk.

A chunk is ``list[dict[str, Tensor | ndarray]]``: groups of named fields whose first dimension is the number of
rows in the chunk. The layout records, per field, the dtype and the shape of one row; the buffer stores each
field as raw bytes (``[slots, row_bytes]``), so copies are dtype-agnostic and one op per field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from gigashuffle.errors import SchemaError

INDEX_KEY = "gigashuffle_index"
"""Key of the ``(bs,)`` int64 tensor of slot indices that every batch carries in ``batch[0]``."""

_SUPPORTED: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)),
    )
}
_SUPPORTED_DTYPES = frozenset(_SUPPORTED.values())
_NUMPY_KINDS = "biuf"  # bool, signed, unsigned, float: the kinds torch can view without conversion


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class FieldSpec:
    """One field of a row: where it sits in the chunk, its dtype and the shape of one row."""

    group: int
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"chunk[{self.group}][{self.key!r}]"

    @cached_property  # read per batch and per chunk: np.prod costs microseconds each time
    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def describe(self) -> str:
        return f"{dtype_name(self.dtype)}{list(self.shape)}"


@dataclass(frozen=True)
class Layout:
    """The fields of a row, in chunk order; equal layouts compare equal."""

    fields: tuple[FieldSpec, ...]
    num_groups: int

    @cached_property
    def row_bytes(self) -> int:
        return sum(f.row_bytes for f in self.fields)

    @cached_property
    def _group_keys(self) -> list[list[str]]:
        """The sorted field names of each group, as rows_in compares them."""
        return [sorted(k.key for k in self.fields if k.group == g) for g in range(self.num_groups)]

    def describe(self) -> str:
        return ", ".join(f"{f.label}: {f.describe()}" for f in self.fields)

    def to_json(self) -> str:
        doc = {
            "num_groups": self.num_groups,
            "fields": [[f.group, f.key, dtype_name(f.dtype), list(f.shape)] for f in self.fields],
        }
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        doc = json.loads(text)
        specs = []
        for group, key, name, shape in doc["fields"]:
            if name not in _SUPPORTED:
                raise SchemaError(f"layout names dtype {name!r}, which this gigashuffle does not support")
            specs.append(FieldSpec(int(group), str(key), _SUPPORTED[name], tuple(int(d) for d in shape)))
        return cls(tuple(specs), int(doc["num_groups"]))

    @classmethod
    def from_chunk(cls, chunk: object) -> Layout:
        groups = _check_groups(chunk)
        specs = []
        for g, group in enumerate(groups):
            for key, value in group.items():
                tensor = _as_tensor(value, g, key)
                specs.append(FieldSpec(g, key, tensor.dtype, tuple(tensor.shape[1:])))
        layout = cls(tuple(specs), len(groups))
        layout.rows_in(chunk)  # the first chunk must obey its own layout (shared first dimension)
        return layout

    def rows_in(self, chunk: object) -> tuple[int, list[torch.Tensor]]:
        """Check ``chunk`` against this layout; return its row count and each field as ``uint8 [rows, bytes]``."""
        groups = _check_groups(chunk)
        expected = self._group_keys
        if len(groups) != self.num_groups or any(sorted(g) != keys for g, keys in zip(groups, expected, strict=True)):
            raise SchemaError(
                f"a chunk's fields differ from the first chunk's: expected {expected}, "
                f"got {[sorted(g) for g in groups]}"
            )
        rows: int | None = None
        as_bytes = []
        for spec in self.fields:
            tensor = _as_tensor(groups[spec.group][spec.key], spec.group, spec.key)
            if tensor.dtype != spec.dtype or tuple(tensor.shape[1:]) != spec.shape:
                got = f"{dtype_name(tensor.dtype)}{list(tensor.shape[1:])}"
                raise SchemaError(
                    f"{spec.label} changed layout: the first chunk had rows of {spec.describe()}, this chunk "
                    f"has {got}; every chunk must keep each field's dtype and row shape (values of varying length: "
                    "gigashuffle.sources.FixedLength gives them one)"
                )
            if rows is None:
                rows = int(tensor.shape[0])
            elif tensor.shape[0] != rows:
                raise SchemaError(
                    f"{spec.label} has {tensor.shape[0]} rows but the chunk's earlier fields have {rows}: "
                    "every field of a chunk must share its first dimension"
                )
            # Only the steps this tensor needs: each torch call costs about a microsecond, per field and chunk.
            raw = tensor if tensor.is_contiguous() else tensor.contiguous()
            if raw.dtype != torch.uint8:
                # A contiguous tensor may still give a last dimension of size 1 any stride (a transposed row), which
                # view() refuses; flattened, its stride is 1.
                raw = (raw if raw.dim() < 2 or raw.stride(-1) == 1 else raw.reshape(-1)).view(torch.uint8)
            if raw.dim() != 2 or raw.shape[1] != spec.row_bytes:
                raw = raw.reshape(rows, spec.row_bytes)
            as_bytes.append(raw)
        return rows or 0, as_bytes


def _check_groups(chunk: object) -> Sequence[dict[str, Any]]:
    if not isinstance(chunk, (list, tuple)) or not chunk:
        raise SchemaError(f"a dataset chunk must be a non-empty list of dicts of tensors, got {type(chunk).__name__}")
    for g, group in enumerate(chunk):
        if not isinstance(group, dict) or not group:
            raise SchemaError(f"chunk[{g}] must be a non-empty dict of tensors, got {type(group).__name__}")
        for key in group:
            if not isinstance(key, str):
                raise SchemaError(f"chunk[{g}] has key {key!r}: field names must be str")
            if g == 0 and key == INDEX_KEY:
                raise SchemaError(f"chunk[0] uses the reserved key {INDEX_KEY!r}; rename that field")
    return chunk


def _as_tensor(value: object, group: int, key: str) -> torch.Tensor:
    if type(value) is torch.Tensor and value.dtype in _SUPPORTED_DTYPES and value.dim() and value.is_cpu:
        # The common case, checked per field of every chunk: nothing to explain, skip building messages.
        return value.detach() if value.requires_grad else value
    label = f"chunk[{group}][{key!r}]"
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _NUMPY_KINDS:
            raise SchemaError(
                f"{label} has numpy dtype {value.dtype}, which a shared buffer cannot hold; "
                "use a bool, integer or float dtype (encode strings as token ids or bytes as uint8)"
            )
        try:
            value = torch.from_numpy(np.ascontiguousarray(value))
        except (TypeError, ValueError) as exc:  # float128, a non-native byte order: kinds right, layout not
            raise SchemaError(
                f"{label} has numpy dtype {value.dtype}, which torch cannot view ({exc}); "
                "convert it with .astype() to a native-endian bool, integer or float dtype of at most 8 bytes"
            ) from exc
    if not isinstance(value, torch.Tensor):
        raise SchemaError(f"{label} is a {type(value).__name__}; every field must be a torch.Tensor or ndarray")
    if value.dtype not in _SUPPORTED_DTYPES:
        raise SchemaError(
            f"{label} has dtype {value.dtype}, which gigashuffle does not support; use one of "
            f"{sorted(_SUPPORTED)} (store a complex field as two float fields)"
        )
    if value.dim() == 0:
        raise SchemaError(f"{label} is a 0-d tensor; every field needs a first (row) dimension")
    if value.device.type != "cpu":
        raise SchemaError(f"{label} lives on {value.device}; datasets must yield CPU tensors")
    return value.detach()
