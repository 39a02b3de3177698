"""Shared memory for the node buffer and the reader rings, and the two copies the loader makes.

NOTE [ Shared memory without names ]
Every shared region is an anonymous ``memfd`` mapped ``MAP_SHARED``. It has no name in ``/dev/shm``, so a
killed process cannot leak one: the kernel frees the memory when the last fd and mapping of it go away. Other
processes get it by fd passing (SCM_RIGHTS, see ``attach.py``), which is the mechanism torch's
``file_descriptor`` sharing strategy uses, without pickling tensors over the socket.

Each field is stored as raw bytes, ``uint8 [rows, row_bytes]``, so writing a chunk and gathering a batch are one
``index_copy_``/``index_select`` per field for every dtype (bfloat16, bool and float8 included).
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .schema import INDEX_KEY, Layout

_ALIGN = 64  # cache line: keeps every field region aligned for any dtype and for vectorised copies


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def wide(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (``uint8 [n, row_bytes]``) as the widest integer type that tiles a row.

    torch's ``index_copy_`` moves one element at a time: on 8-byte elements it is 5-10x faster than on bytes
    (measured: 64 rows of 150 KB, 26 ms as uint8, 2.5 ms as int64). A tensor whose offset does not allow the
    wider view (a user's odd slice) stays as bytes.
    """
    for dtype in (torch.int64, torch.int32, torch.int16):
        if rows.shape[-1] % dtype.itemsize == 0:
            try:
                return rows.view(dtype)
            except RuntimeError:
                continue
    return rows


class SharedMemory:
    """One anonymous shared mapping. ``fd`` stays open only while this process may hand it to others."""

    def __init__(self, nbytes: int, fd: int | None = None, name: str = "gigashuffle") -> None:
        if nbytes <= 0:
            raise ValueError(f"shared memory size must be positive, got {nbytes}")
        if fd is None:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
        elif os.fstat(fd).st_size < nbytes:
            raise ValueError(f"shared memory fd {fd} holds {os.fstat(fd).st_size} bytes, expected {nbytes}")
        self.nbytes = nbytes
        self.fd: int | None = fd
        # The mapping lives as long as any tensor made from it (torch keeps a reference to the exporter), so a
        # batch the caller still holds stays valid after close().
        self._map: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor over ``[offset, offset + nbytes)`` of the mapping."""
        if self._map is None:
            raise ValueError("shared memory is closed")
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)

    def numpy_view(self, offset: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        if self._map is None:
            raise ValueError("shared memory is closed")
        return np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=offset)

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        """Drop this object's hold on the memory; live tensor views keep the mapping until they die."""
        self.close_fd()
        self._map = None


def _field_offsets(layout: Layout, rows: int) -> tuple[list[int], int]:
    offsets, total = [], 0
    for spec in layout.fields:
        offsets.append(total)
        total += _align(rows * spec.row_bytes)
    return offsets, total


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
        self._wide_regions = [wide(region) for region in self.regions]

    def write(self, slot_ids: torch.Tensor, rows: Sequence[torch.Tensor], start: int) -> None:
        """Copy ``rows[f][start : start + len(slot_ids)]`` into the given slots, one op per field."""
        end = start + len(slot_ids)
        for region, wide_region, src in zip(self.regions, self._wide_regions, rows, strict=True):
            part = wide(src[start:end])
            if part.dtype == wide_region.dtype:
                wide_region.index_copy_(0, slot_ids, part)
            else:
                region.index_copy_(0, slot_ids, src[start:end])

    def gather(self, slot_ids: torch.Tensor, out: Sequence[torch.Tensor]) -> None:
        """Copy the given slots into ``out`` (one ``[len(slot_ids), row_bytes]`` tensor per field)."""
        for region, dst in zip(self.regions, out, strict=True):
            torch.index_select(region, 0, slot_ids, out=dst)

    def read_rows(self, slot_ids: torch.Tensor) -> list[torch.Tensor]:
        return [torch.index_select(region, 0, slot_ids) for region in self.regions]

    def close(self) -> None:
        self.regions = []
        self._wide_regions = []
        self.memory.close()


class BatchRing:
    """A reader's ring of ``depth`` batch slots, each holding ``bs`` rows, their slot indices and the version of
    each slot's write (so a later ``evict`` can tell that write from a newer one; see NOTE [ Slot table ])."""

    def __init__(self, layout: Layout, bs: int, depth: int, memory: SharedMemory | None = None) -> None:
        offsets, fields_bytes = _field_offsets(layout, bs)
        self.layout = layout
        self.bs = bs
        self.depth = depth
        self.index_offset = fields_bytes
        self.field_offsets = offsets
        self.versions_offset = fields_bytes + bs * 8
        self.slot_bytes = _align(fields_bytes + bs * 16)
        self.nbytes = self.slot_bytes * depth
        self.memory = memory or SharedMemory(self.nbytes, name="gigashuffle-ring")
        self._regions: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def regions(self, k: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Writable byte regions of ring slot ``k`` (one per field) and its int64 index tensor."""
        if k not in self._regions:
            self._regions[k] = self._make_regions(k)
        return self._regions[k]

    def _make_regions(self, k: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        base = k * self.slot_bytes
        fields = [
            self.memory.view(base + off, self.bs * spec.row_bytes).view(self.bs, spec.row_bytes)
            for off, spec in zip(self.field_offsets, self.layout.fields, strict=True)
        ]
        index = self.memory.view(base + self.index_offset, self.bs * 8).view(torch.int64)
        return fields, index

    def versions(self, k: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The int64 versions of ring slot ``k``'s rows, one per index."""
        return self.memory.numpy_view(k * self.slot_bytes + self.versions_offset, self.bs * 8).view(np.int64)

    def batch(self, k: int, on_release: Callable[[], None] | None = None) -> list[dict[str, torch.Tensor]]:
        """Typed zero-copy views of ring slot ``k`` shaped like the dataset's chunks.

        All views share one storage whose owner is a fresh numpy array; ``on_release`` runs when the last view
        (or any view derived from it) is gone, which is when the ring slot may be overwritten.
        """
        owner = self.memory.numpy_view(k * self.slot_bytes, self.slot_bytes)
        if on_release is not None:
            weakref.finalize(owner, on_release)
        raw = torch.from_numpy(owner)
        batch: list[dict[str, torch.Tensor]] = [{} for _ in range(self.layout.num_groups)]
        for off, spec in zip(self.field_offsets, self.layout.fields, strict=True):
            field = raw[off : off + self.bs * spec.row_bytes].view(spec.dtype)
            batch[spec.group][spec.key] = field.view(self.bs, *spec.shape)
        batch[0][INDEX_KEY] = raw[self.index_offset : self.index_offset + self.bs * 8].view(torch.int64)
        return batch

    def close(self) -> None:
        self._regions.clear()
        self.memory.close()
