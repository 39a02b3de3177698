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
        group[key] = torch.stack(values)
    return [group]
