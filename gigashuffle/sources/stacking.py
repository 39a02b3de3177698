"""Per-sample dicts stacked into a chunk: the one place that knows which sample values have a tensor form.

Used by :class:`gigashuffle.sources.Chunked` (samples from a source) and
:class:`gigashuffle.sources.tarshards.TarReader` (samples from a tar shard); ``who`` names the caller in errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

Chunk = list[dict[str, torch.Tensor]]


def as_tensor(key: str, value: Any, who: str = "Chunked") -> torch.Tensor:
    """``value`` of sample field ``key`` as a tensor (tensors, numpy arrays, numbers and lists of numbers)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, np.generic, bool, int, float)) or (
        isinstance(value, (list, tuple)) and not any(isinstance(v, (str, bytes)) for v in value)
    ):
        return torch.as_tensor(value)
    raise TypeError(
        f"{who}: sample field {key!r} is a {type(value).__name__}, which has no tensor form; pass fields=(...) "
        "naming only numeric fields, or decode it first (e.g. webdataset's .decode(), datasets' .map(), a "
        "transform=)"
    )


def default_fields(sample: Mapping[str, Any]) -> list[str]:
    """Every field of ``sample`` whose name does not start with ``__`` (webdataset's ``__key__``/``__url__``)."""
    return [k for k in sample if not k.startswith("__")]


def stack(samples: Sequence[Mapping[str, Any]], keys: Sequence[str], who: str = "Chunked") -> Chunk:
    """One chunk: each field in ``keys`` is the samples' values stacked along a new first dimension."""
    group: dict[str, torch.Tensor] = {}
    for key in keys:
        try:
            values = [as_tensor(key, sample[key], who) for sample in samples]
        except KeyError as exc:
            raise KeyError(
                f"{who}: a sample has no field {key!r}; every sample must have the fields {list(keys)}"
            ) from exc
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            a, b = sorted(shapes)[:2]
            raise ValueError(
                f"{who}: sample field {key!r} has values of different shapes ({list(a)} and {list(b)}), and a "
                "field's rows must all have one shape; make them one length in transform= (FixedLength pads or "
                "cuts token ids to a length and records the length before), or pack them into blocks of one length"
            )
        group[key] = torch.stack(values)
    return [group]


class FixedLength:
    """A ``transform=`` for :class:`Chunked` and ``TarReader`` that gives variable-length fields one length:
    each field named in ``lengths`` (token ids, a sequence of frames) is cut or padded with ``pad`` along its first
    dimension to its length; with ``length_field``, a field of that name (``{}`` is the field's name) holds how many
    of its values are real (its length before padding, at most the length). Other fields pass as they are.

    ``Chunked(source, rows=256, transform=FixedLength({"input_ids": 512}, pad=tokenizer.pad_token_id))``
    """

    def __init__(
        self, lengths: Mapping[str, int], pad: int | float = 0, length_field: str | None = "{}_length"
    ) -> None:
        for key, length in lengths.items():
            if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                raise ValueError(f"FixedLength: lengths[{key!r}]={length!r} is invalid: use a positive int")
        if length_field is not None and "{}" not in length_field:
            raise ValueError(
                f"FixedLength: length_field={length_field!r} is invalid: it needs a '{{}}' for the field's name "
                "(e.g. '{}_length'), or None for no length field"
            )
        self.lengths = dict(lengths)
        self.pad = pad
        self.length_field = length_field

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(sample)
        for key, length in self.lengths.items():
            if key not in sample:
                raise KeyError(f"FixedLength: a sample has no field {key!r}; its fields are {list(sample)}")
            value = as_tensor(key, sample[key], "FixedLength")
            if value.dim() == 0:
                raise ValueError(f"FixedLength: sample field {key!r} is a scalar; it has no length to fix")
            real = min(int(value.shape[0]), length)
            fixed = value.new_full((length, *value.shape[1:]), self.pad)
            fixed[:real] = value[:real]
            out[key] = fixed
            if self.length_field is not None:
                out[self.length_field.format(key)] = real
        return out
