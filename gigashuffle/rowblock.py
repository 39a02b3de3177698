"""``RowBlock``: rows as bytes, the one shape saved rows have wherever they travel.

A checkpoint saves rows (NOTE [ Checkpoint cut ] in checkpoint/cut.py) and they go many ways: from the cut into the
checkpoint dict, from the dict to a writer (``LoadState``, ``ChildSpec``), from a writer that has not put them all
back into its answer (``DatasetState``) and to its successor (checkpoint/respawn.py), from an elastic re-split
(checkpoint/elastic.py) and from batches handed out and not trained on (checkpoint/unconsumed.py). Each carries a
``RowBlock``: the buffer layout's JSON and one ``uint8 [n, row_bytes]`` array per field (numpy or torch; the
checkpoint dict holds torch tensors). Only the dict has another shape, ``{"layout", "fields", "count", "crc32"}``
(docs/checkpoint-format.md), made and checked here.

numpy and torch are imported where rows are handled, not at import: the channel's messages carry a ``RowBlock``,
and a process that only reads messages (tests/chaos/test_security.py's client of another user) has neither.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gigashuffle.errors import CheckpointError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RowBlock:
    layout_json: str = ""
    fields: tuple[Any, ...] = ()  # per field, uint8 [n, row_bytes]; all with the same n

    def __len__(self) -> int:
        return int(self.fields[0].shape[0]) if self.fields else 0

    def after(self, n: int) -> RowBlock:
        """The rows from the ``n``-th on (views, no copy); an empty block when none is left."""
        if n >= len(self):
            return RowBlock()
        return RowBlock(self.layout_json, tuple(f[n:] for f in self.fields)) if n else self

    def span(self, lo: int, hi: int) -> RowBlock:
        """Rows ``lo:hi`` (views)."""
        return RowBlock(self.layout_json, tuple(f[lo:hi] for f in self.fields)) if hi > lo else RowBlock()

    def dealt(self, n: int) -> list[RowBlock]:
        """``n`` contiguous shares of the rows (views), the first ``len % n`` one row longer (``share_bounds``)."""
        return [self.span(lo, hi) for lo, hi in share_bounds(len(self), n)]

    @staticmethod
    def joined(blocks: Sequence[RowBlock]) -> RowBlock:
        """The rows of ``blocks`` one after the other (torch tensors); the empty ones are left out."""
        blocks = [b for b in blocks if len(b)]
        if not blocks:
            return RowBlock()
        if len(blocks) == 1:
            return blocks[0].as_tensors()
        layouts = {b.layout_json for b in blocks}
        if len(layouts) > 1:
            raise CheckpointError(
                "load_state_dict: saved rows of different row layouts cannot be joined; the checkpoint mixes parts "
                "of different jobs"
            )
        import torch

        columns = zip(*(b.as_tensors().fields for b in blocks), strict=True)
        return RowBlock(layouts.pop(), tuple(torch.cat(list(column)) for column in columns))

    def as_tensors(self) -> RowBlock:
        """The same rows as torch tensors (numpy arrays are wrapped, not copied)."""
        import torch

        if all(isinstance(f, torch.Tensor) for f in self.fields):
            return self
        return RowBlock(self.layout_json, tuple(_tensor(f) for f in self.fields))

    def crc32(self) -> int:
        """CRC-32 of the rows' bytes, field after field."""
        import numpy as np
        import torch

        crc = 0
        for field in self.fields:
            array = field.contiguous().numpy() if isinstance(field, torch.Tensor) else np.ascontiguousarray(field)
            crc = zlib.crc32(array.data, crc)  # the buffer itself: no copy of the rows
        return crc

    # -- the checkpoint dict's shape (docs/checkpoint-format.md) ----------------------------------------------
    def to_part(self) -> dict[str, Any]:
        """The part's ``"rows"`` entry: ``{}`` for no rows."""
        if not len(self):
            return {}
        block = self.as_tensors()
        return {"layout": block.layout_json, "fields": list(block.fields), "count": len(block), "crc32": block.crc32()}

    @classmethod
    def from_part(cls, key: str, rows: Any) -> RowBlock:
        """A part's ``"rows"`` entry, checked: shape, count and checksum (a truncated or tampered part is refused)."""
        import torch

        if not rows:
            return cls()
        fields = rows.get("fields") if isinstance(rows, dict) else None
        if (
            not isinstance(rows, dict)
            or not isinstance(rows.get("layout"), str)
            or not isinstance(fields, list)
            or not fields
            or not all(isinstance(f, torch.Tensor) and f.dtype == torch.uint8 and f.dim() == 2 for f in fields)
            or len({int(f.shape[0]) for f in fields}) > 1
        ):
            raise CheckpointError(
                f"load_state_dict: {key}['rows'] must be {{'layout': str, 'fields': [uint8 tensor [n, row_bytes] per "
                "field, all with the same n], 'count': n, 'crc32': int}} as state_dict() saved it; the checkpoint "
                "is damaged"
            )
        block = cls(rows["layout"], tuple(fields))
        if rows.get("count") != len(block):
            raise CheckpointError(
                f"load_state_dict: {key}['rows'] holds {len(block)} rows but the checkpoint saved "
                f"{rows.get('count')!r}: it is truncated or damaged; load an intact copy"
            )
        crc = block.crc32()
        if rows.get("crc32") != crc:
            raise CheckpointError(
                f"load_state_dict: {key}['rows'] does not match its checksum (crc32 {crc} != saved "
                f"{rows.get('crc32')!r}): the saved rows were altered or damaged; load an intact copy"
            )
        return block


def share_bounds(count: int, n: int) -> list[tuple[int, int]]:
    """``(lo, hi)`` of ``n`` contiguous shares of ``count`` rows, the first ``count % n`` one row longer."""
    size, extra = divmod(count, n)
    bounds, lo = [], 0
    for i in range(n):
        hi = lo + size + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _tensor(field: Any) -> torch.Tensor:
    import numpy as np
    import torch

    return field if isinstance(field, torch.Tensor) else torch.from_numpy(np.asarray(field))


NO_ROWS = RowBlock()  # the default wherever a block may be absent (a frozen value: safe to share)
