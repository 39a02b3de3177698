"""Batches the caller was handed but did not train on, turned back into rows for a checkpoint.

A framework that fetches ahead (Lightning's fit loop takes batch N+1 before step N runs) has, at the checkpoint of
step N, been handed one batch more than it trained on. ``state_dict(unconsumed=[batch])`` saves such batches' rows
with the undelivered ones (NOTE [ Checkpoint cut ] in checkpoint/cut.py), so a resume brings them back once. The rows
are read from the batch tensors themselves (on any device), so it works whether the batch is a zero-copy view of a
ring slot, a copy, or already on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gigashuffle.errors import SchemaError
from gigashuffle.rowblock import RowBlock
from gigashuffle.schema import INDEX_KEY, Layout
from gigashuffle.trainer.supervisor import Supervisor


def rows_of(batches: Sequence[Any], layout: Layout, batch_format: str) -> list[np.ndarray[Any, Any]]:
    """The rows of ``batches`` (each as ``iter(loader)`` yields it: ``list[dict]``, or ``dict`` with
    ``batch_format="dict"``), one ``uint8 [rows, row_bytes]`` array per field of ``layout``."""
    if isinstance(batches, (dict, torch.Tensor)) or not isinstance(batches, Sequence):
        raise TypeError(
            f"state_dict(unconsumed={type(batches).__name__}) needs a list of the batches handed out and not trained "
            "on (e.g. [batch]), each as iter(loader) yielded it"
        )
    parts: list[list[np.ndarray[Any, Any]]] = [[] for _ in layout.fields]
    for n, batch in enumerate(batches):
        groups = [batch] if batch_format == "dict" else batch
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            shape = "a dict" if batch_format == "dict" else "a list of dicts"
            raise TypeError(
                f"state_dict(unconsumed=...): item {n} is a {type(batch).__name__}, but this loader yields each "
                f"batch as {shape} (batch_format={batch_format!r}); pass a list of batches as iter(loader) yielded "
                "them, e.g. [batch]"
            )
        chunk = [{k: _host(v) for k, v in g.items() if k != INDEX_KEY} for g in groups]
        try:
            _rows, fields = layout.rows_in(chunk)
        except SchemaError as error:
            raise ValueError(
                f"state_dict(unconsumed=...): item {n} is not a batch of this loader ({error}); pass the batches "
                "exactly as iter(loader) yielded them, unmodified"
            ) from error
        for part, field in zip(parts, fields, strict=True):
            part.append(field.numpy())
    empty = [np.empty((0, f.row_bytes), np.uint8) for f in layout.fields]
    return [np.concatenate(p) if p else e for p, e in zip(parts, empty, strict=True)]


def _host(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def unconsumed_rows(batches: Sequence[Any], sup: Supervisor) -> RowBlock:
    """The rows of ``batches`` in the layout of this rank's reader rings (the batches came from them)."""
    layout = next((c.ring.layout for c in sup.readers() if c.ring is not None), None)
    if layout is None:
        raise ValueError(
            "state_dict(unconsumed=...) was given batches, but this loader has handed out none (no reader ring "
            "yet); pass only batches that iter(loader) yielded"
        )
    return RowBlock(layout.to_json(), tuple(rows_of(batches, layout, sup.config.batch_format)))
