"""Image-sized rows of several dtypes for the GPU tests (an importable module: the writers unpickle the dataset by
name). Every field of a row derives from its id, so a row read before its copy landed, or out of a block refilled
under the read, is found on the GPU without a host sync (``bad_rows``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

SHAPE = (3, 224, 224)  # a 150 KB uint8 image: a copy of a batch takes real time on the bus
PIXELS = SHAPE[0] * SHAPE[1] * SHAPE[2]
ID_STRIDE = 10**8


def _image(ids: torch.Tensor) -> torch.Tensor:
    """A pattern no two nearby ids share: pixel ``p`` of row ``id`` is ``(id * 7 + p) % 251``."""
    pixels = torch.arange(PIXELS, device=ids.device, dtype=torch.int64)
    return ((ids.unsqueeze(1) * 7 + pixels) % 251).to(torch.uint8).view(-1, *SHAPE)


def rows(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    small = ids % 256  # exact in every dtype below
    return {
        "id": ids,
        "image": _image(ids),
        "half": small.to(torch.float16).unsqueeze(1).repeat(1, 17),
        "bf16": small.to(torch.bfloat16).unsqueeze(1).repeat(1, 5),
        "label": small.to(torch.int32),
    }


class ImageRows(IterableDataset):  # type: ignore[type-arg]
    """Endless chunks of ``chunk`` image rows with ids unique across writers."""

    def __init__(self, chunk: int = 8) -> None:
        self.chunk = chunk

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        info = get_worker_info()
        first = (info.id if info is not None else 0) * ID_STRIDE
        for n in itertools.count(0, self.chunk):
            yield [rows(torch.arange(first + n, first + n + self.chunk, dtype=torch.int64))]


def bad_rows(group: dict[str, torch.Tensor]) -> torch.Tensor:
    """How many rows of a batch on the GPU are not what their id says (a 0-d tensor on the GPU: no host sync)."""
    want = rows(group["id"])
    bad = torch.zeros(group["id"].shape[0], dtype=torch.bool, device=group["id"].device)
    for key in ("image", "half", "bf16", "label"):
        bad |= (group[key] != want[key]).view(bad.shape[0], -1).any(dim=1)
    return bad.sum()
