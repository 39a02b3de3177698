"""An elastic resume of a checkpoint by positions: the rows its writers were to re-read, read here as saved rows.

NOTE [ Positions across layouts ]
A checkpoint by positions (NOTE [ Positions checkpoint ] in checkpoint/positions.py) gives each writer a state (at
stream row ``at``), the offsets after it of the unconsumed rows to write again (``keep``) and ``until``, from which
it writes every row; its ``skip`` drops the first rows too (``procs/positions.folded``). A re-split over other
writers (NOTE [ Elastic resume ] in checkpoint/elastic.py) moves states and plain skips only, so ``load_state_dict``
turns each old writer's filter into what a re-split carries before re-splitting: it reads that writer's stream
from its state in the training process, takes the rows of ``keep`` as saved rows (put back by the new ranks like
any checkpoint's saved rows), and leaves a plain skip of ``max(until, skip)``. Every rank computes the same cut of
all saved rows into shares and reads only the old writers whose kept rows fall in its own share, up to the last
of them. The dataset must re-read deterministically from a state, as checkpoints by positions require anyway; a
stream that ends before a kept row is refused, naming the writer.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gigashuffle.errors import CheckpointError
from gigashuffle.procs.workerinfo import standing_in_for
from gigashuffle.rowblock import RowBlock
from gigashuffle.schema import Layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kept:
    """The rows an old writer was to re-read: stream offsets after its state, and how to read them."""

    count: int
    read: Callable[[], RowBlock]


def fold(
    dataset: Any, key: str, part: dict[str, Any], first_worker: int = 0, num_workers: int = 1
) -> tuple[list[int], list[Kept]]:
    """A part's skips with every positions filter folded in, and what each filter kept (``Kept`` in writer order,
    only those with rows). ``first_worker``: the worker id of the part's writer 0 in the old job of
    ``num_workers`` writers: each re-read sees that writer's ``get_worker_info()``, as it did."""
    skips = list(part["skip"])
    kept: list[Kept] = []
    for i, entry in enumerate(part.get("positions") or []):
        if entry is None:
            continue
        skip = int(skips[i])
        offsets = entry["keep"].numpy().astype(np.int64)
        offsets = offsets[offsets >= skip]
        skips[i] = max(int(entry["until"]), skip)
        if len(offsets):
            state = part["writers"][i]
            who = f"{key}'s writer {i}"
            worker = (first_worker + i, num_workers)
            kept.append(Kept(len(offsets), functools.partial(_read, dataset, state, offsets, who, worker)))
    return skips, kept


def _read(dataset: Any, state: Any, offsets: np.ndarray[Any, Any], who: str, worker: tuple[int, int]) -> RowBlock:
    """Rows ``offsets`` (sorted) of the stream of a copy of ``dataset`` loaded with ``state``, read as the old
    writer ``worker`` (its id, of how many) that wrote it: a dataset that shards by ``get_worker_info()``."""
    source = copy.deepcopy(dataset)
    with standing_in_for(*worker, source):
        return _read_as_worker(source, state, offsets, who, dataset)


def _read_as_worker(source: Any, state: Any, offsets: np.ndarray[Any, Any], who: str, dataset: Any) -> RowBlock:
    source.load_state_dict(copy.deepcopy(state))
    picked: list[list[torch.Tensor]] = []
    layout: Layout | None = None
    offset, last = 0, int(offsets[-1])
    while offset <= last:
        before = offset
        for chunk in source:  # one pass; a finite source's next iter() is its next pass
            if layout is None:
                layout = Layout.from_chunk(chunk)
            rows, as_bytes = layout.rows_in(chunk)
            lo, hi = np.searchsorted(offsets, (offset, offset + rows))
            if hi > lo:
                index = torch.from_numpy(offsets[lo:hi] - offset)
                picked.append([field.index_select(0, index) for field in as_bytes])
            offset += rows
            if offset > last:
                break
        if offset == before:
            raise CheckpointError(
                f"load_state_dict: {who} must re-read rows up to {last} after its state, but the dataset "
                f"{type(dataset).__name__} ended after {offset}: it does not re-read the same rows from a loaded "
                "state, which a checkpoint by positions needs"
            )
    if layout is None:
        raise AssertionError("rows read without a layout")
    log.info("elastic resume: read %d rows of %s's stream again to keep %d of them", offset, who, len(offsets))
    return RowBlock(layout.to_json(), tuple(torch.cat(list(column)) for column in zip(*picked, strict=True)))


def share(segments: list[RowBlock | Kept], rank: int, world: int) -> list[RowBlock]:
    """Share ``rank`` of ``world`` of the segments' rows in order: ``world`` contiguous shares of the concatenated
    rows, reading only the kept rows that fall in this one."""
    counts = [s.count if isinstance(s, Kept) else len(s) for s in segments]
    bounds = np.linspace(0, sum(counts), world + 1).astype(np.int64)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    mine: list[RowBlock] = []
    start = 0
    for segment, count in zip(segments, counts, strict=True):
        a, b = max(lo, start), min(hi, start + count)
        if a < b:
            rows = segment.read() if isinstance(segment, Kept) else segment
            mine.append(rows.span(a - start, b - start))
        start += count
    return mine
