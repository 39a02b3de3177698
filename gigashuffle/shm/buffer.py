"""``SlotBuffer``: the node-wide buffer in shared memory, which writers ``put`` rows into and readers ``take``
batches from (NOTE [ Row copies ] in shm/rowcopies.py). The shared memory, the reader rings and the row form live in
modules of their own; what the rest of the loader imports from here stays importable from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from gigashuffle.schema import Layout
from gigashuffle.shm.memfd import SharedMemory
from gigashuffle.shm.ring import RING_BUDGET_BYTES, BatchRing, handed_out, reclaim, ring_depth_for
from gigashuffle.shm.rowcopies import _field_offsets, row_elements

SlotIdArray = npt.NDArray[np.integer[Any]]


def _as_numpy(rows: torch.Tensor | npt.NDArray[Any]) -> npt.NDArray[Any]:
    return rows.numpy() if isinstance(rows, torch.Tensor) else rows


def buffer_nbytes(layout: Layout, slots: int) -> int:
    """The bytes of a node buffer of ``slots`` rows of ``layout`` (before it is made: NOTE [ A buffer the node
    cannot hold ] in host/memory.py)."""
    return _field_offsets(layout, slots)[1]


class SlotBuffer:
    """The node-wide buffer: ``slots`` rows of ``layout``, one byte region per field."""

    def __init__(self, layout: Layout, slots: int, memory: SharedMemory | None = None) -> None:
        offsets, total = _field_offsets(layout, slots)
        self.layout = layout
        self.slots = slots
        self.nbytes = total
        self.memory = memory or SharedMemory(total, name="gigashuffle-buffer")
        self.regions = [
            self.memory.view(off, slots * spec.row_bytes).view(slots, spec.row_bytes)
            for off, spec in zip(offsets, layout.fields, strict=True)
        ]
        # One element per row and field: NOTE [ Row copies ].
        self._rows = [row_elements(region.numpy()) for region in self.regions]

    def write(self, slot_ids: torch.Tensor | SlotIdArray, rows: Sequence[torch.Tensor], start: int) -> None:
        """Copy ``rows[f][start : start + len(slot_ids)]`` (``uint8 [n, row_bytes]`` per field) into the given
        slots, one ``put`` per field (which raises on an id out of range)."""
        self.put(slot_ids, [row_elements(src.numpy()) for src in rows], start)

    def put(self, slot_ids: torch.Tensor | SlotIdArray, elements: Sequence[npt.NDArray[Any]], start: int) -> None:
        """``write`` for rows already in their copy form (per field the 1-D ``row_elements``, as ``ChunkRows``
        cuts a writer's chunks): one ``put`` per field."""
        ids = _as_numpy(slot_ids)
        end = start + len(ids)
        for dest, src in zip(self._rows, elements, strict=True):
            dest.put(ids, src[start:end] if start or end != len(src) else src)

    def gather(
        self,
        slot_ids: torch.Tensor | SlotIdArray,
        out: Sequence[torch.Tensor | npt.NDArray[Any]],
        *,
        ids_in_range: bool = False,
    ) -> None:
        """Copy the given slots into ``out``: per field a ``uint8 [len(slot_ids), row_bytes]`` tensor or array, or
        the ``row_elements`` of one (what a reader's ring keeps, so that no view is made per batch).
        ``ids_in_range``: the caller vouches that every id lies in ``[0, slots)`` (ids the slot table of this
        buffer handed out), which skips the check, a fifth of a small batch's gather."""
        ids = _as_numpy(slot_ids)
        if not ids_in_range and len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.slots):
            raise IndexError(f"slot ids must lie in [0, {self.slots}), got [{ids.min()}, {ids.max()}]")
        for src, dst in zip(self._rows, out, strict=True):
            dst_rows = _as_numpy(dst)
            if dst_rows.ndim != 1:
                dst_rows = row_elements(dst_rows)
            # In range, checked above: NOTE [ Row copies ]. The method, not np.take: its wrapper cost 0.5 us a call.
            src.take(ids, out=dst_rows, mode="clip")

    def read_rows(self, slot_ids: torch.Tensor) -> list[torch.Tensor]:
        return [torch.index_select(region, 0, slot_ids) for region in self.regions]

    def close(self) -> None:
        self.regions = []
        self._rows = []
        self.memory.close()


__all__ = [
    "RING_BUDGET_BYTES",
    "BatchRing",
    "SharedMemory",
    "SlotBuffer",
    "SlotIdArray",
    "buffer_nbytes",
    "handed_out",
    "reclaim",
    "ring_depth_for",
    "row_elements",
]
