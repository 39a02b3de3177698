"""``BatchRing``: a reader's ring of batch slots, how deep it is, and how a slot comes back once its batch is gone."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from gigashuffle.schema import INDEX_KEY, Layout
from gigashuffle.shm.memfd import SharedMemory
from gigashuffle.shm.rowcopies import _align, _field_offsets, numpy_dtype, row_elements
from gigashuffle.shm.slotqueue import SlotQueue, queue_bytes

# NOTE [ Reclaimed ring slots ]
# A ring slot goes back to its reader once every view of its batch is gone. That moment is the caller's: the last
# view dies at whatever bytecode of the script drops it, in any thread, in a garbage collection. A weakref callback
# run there is Python code, and a signal can cut it: a script's own SIGINT handler (or Python's) raised
# ``KeyboardInterrupt`` on its first line ("Exception ignored in: <function _released>") and the slot was lost for
# good; no section can be around code that runs wherever the caller is. So the death of a batch runs nothing of
# ours: ``batch()`` registers a weak reference *without a callback* to the array that owns the slot's bytes, with
# what returns the slot, in ``_HANDED``; ``reclaim()`` walks the registry and returns the slots of the dead ones.
# The loader calls it where it already runs, before it drains what was returned (``DroppedBatches.due`` under
# ``Inbox.flush``: every ``next()``, every pump of a wait; ``ReleaseQueue`` with pinned rings), always inside a
# ``critical()`` section of procs/interrupts.py. It cannot be interrupted there: in a section of the main thread
# SIGINT's Python handler is gigashuffle's, which only records the signal, whatever handler the script installed
# before or after the loader (the section puts its own in on entry and the script's back on exit), and other
# threads never run Python signal handlers. An interrupt before the section is entered leaves the registry as it
# was, to be walked next time, and ``dict.pop`` hands each entry to exactly one walk, so a slot goes back once.
# The walk is O(batches the caller holds) (each at most a ring slot: past ``ring_depth - 1`` the caller gets
# copies), one dead-reference test each, and makes no view per batch.
# Module-level, as weakref.finalize's registry is: a slot still goes back when the ring object that made the batch
# is gone first (a pinned ring's release must still reach its queue).
_HANDED: dict[int, tuple[weakref.ref[Any], Callable[[], None]]] = {}


def reclaim() -> int:
    """Run the release of every handed-out batch whose views are all gone, once each (NOTE [ Reclaimed ring
    slots ]); returns how many. The caller runs it inside a ``critical()`` section."""
    if not _HANDED:
        return 0
    reclaimed = 0
    for key, (ref, _release) in list(_HANDED.items()):
        if ref() is None:
            entry = _HANDED.pop(key, None)  # atomic: a second walk (another thread's) finds it gone
            if entry is not None:
                entry[1]()
                reclaimed += 1
    return reclaimed


def handed_out() -> int:
    """Batches handed out whose slots ``reclaim()`` has not returned yet (alive, or dead and not yet walked)."""
    return len(_HANDED)


def _numpy_cut(dtype: torch.dtype) -> tuple[np.dtype[Any], torch.dtype | None]:
    """The numpy dtype to cut a field of ``dtype`` as, and the torch dtype to view it as then (None: as cut)."""
    twin = numpy_dtype(dtype)
    # No numpy equivalent (bfloat16, float8): cut as the unsigned int of the same size.
    return (twin, None) if twin is not None else (np.dtype(f"u{dtype.itemsize}"), dtype)


# NOTE [ Ring depth ]
# A reader draws the slots of as many batches as it has free ring slots under one hold of the node lock, and the
# trainer is woken once per draw (NOTE [ Reader cycle ] in procs/reader.py), so a deeper ring means fewer transitions,
# messages and wake-ups per batch. Measured with ``gigashuffle bench`` (1 writer, 1 reader, 3 s, two rounds side by
# side with baselines; docs/benchmarks.md): depth 4 -> 8 took tokens from 356-367k to 431-433k rows/s and 4.8-4.9 to
# 4.05 CPU-us per row, tiny from 4.2-4.4M to 5.05M rows/s and 0.38-0.39 to 0.28. Depth 16 gained a little more but
# let the readers drain the buffer to the mixing threshold (displacement ratio ~0.5). A ring costs
# ``depth * bs * row bytes`` per reader (pinned, with a device), so the automatic depth takes 8 batches while they
# fit in RING_BUDGET_BYTES and never fewer than 4 (image-sized batches of 38 MB stay at 4).
RING_BUDGET_BYTES = 64 << 20
_AUTO_DEPTHS = (4, 8)


def ring_depth_for(configured: int | None, layout: Layout, bs: int) -> int:
    """The ring depth a reader uses: ``configured``, or for None the automatic depth of NOTE [ Ring depth ]."""
    if configured is not None:
        return configured
    least, most = _AUTO_DEPTHS
    batch_bytes = max(1, bs * layout.row_bytes)
    return max(least, min(most, RING_BUDGET_BYTES // batch_bytes))


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
        # Each row's origin after the versions (NOTE [ Positions checkpoint ] in checkpoint/positions.py).
        self.origins_offset = fields_bytes + bs * 16
        self.slot_bytes = _align(fields_bytes + bs * 24)
        seq_at = self.slot_bytes * depth
        returns_at = seq_at + _align(8 * depth)
        announcements_at = returns_at + _align(queue_bytes(depth))
        self.nbytes = announcements_at + _align(queue_bytes(depth))
        self.memory = memory or SharedMemory(self.nbytes, name="gigashuffle-ring")
        # Per ring slot, the sequence number of the batch the reader gathered into it and has not yet announced; 0
        # once the trainer has it (NOTE [ Lanes ] in shm/lanes.py).
        self.seq = self.memory.numpy_view(seq_at, 8 * depth).view(np.int64)
        # The ring's slots on their way, both ways (NOTE [ Slot queues ] in shm/slotqueue.py): gathered batches to
        # the trainer, and slots of dropped batches back to the reader.
        self.announcements = SlotQueue(self._words(announcements_at, queue_bytes(depth)), depth)
        self.returns = SlotQueue(self._words(returns_at, queue_bytes(depth)), depth)
        self._regions: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}
        self._versions: dict[int, np.ndarray[Any, np.dtype[np.int64]]] = {}
        self._origins: dict[int, np.ndarray[Any, np.dtype[np.int64]]] = {}
        self._targets: dict[int, tuple[list[npt.NDArray[Any]], npt.NDArray[np.int64], npt.NDArray[np.int64]]] = {}
        # What batch() cuts out of a ring slot, worked out once (batch() runs once per delivered batch in the
        # trainer): per field its group, key, byte offset, the numpy dtype it is cut as, the torch dtype to view it
        # as afterwards when numpy has no such dtype (bfloat16, float8: cut as same-size ints), and its batch shape.
        self._cuts = [
            (spec.group, spec.key, off, *_numpy_cut(spec.dtype), (bs, *spec.shape))
            for off, spec in zip(offsets, layout.fields, strict=True)
        ]

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

    def targets(self, k: int) -> tuple[list[npt.NDArray[Any]], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """What a reader fills in ring slot ``k``: each field's ``row_elements``, the int64 index and versions."""
        found = self._targets.get(k)
        if found is None:
            fields, index = self.regions(k)
            found = self._targets[k] = ([row_elements(f.numpy()) for f in fields], index.numpy(), self.versions(k))
        return found

    def versions(self, k: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The int64 versions of ring slot ``k``'s rows, one per index."""
        found = self._versions.get(k)
        if found is None:
            raw = self.memory.numpy_view(k * self.slot_bytes + self.versions_offset, self.bs * 8)
            found = self._versions[k] = raw.view(np.int64)
        return found

    def origins(self, k: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The int64 origins of ring slot ``k``'s rows (filled only by readers of a loader that checkpoints by
        positions)."""
        found = self._origins.get(k)
        if found is None:  # made once per ring slot: a reader fills it per batch
            raw = self.memory.numpy_view(k * self.slot_bytes + self.origins_offset, self.bs * 8)
            found = self._origins[k] = raw.view(np.int64)
        return found

    def batch(self, k: int, on_release: Callable[[], None] | None = None) -> list[dict[str, torch.Tensor]]:
        """Typed zero-copy views of ring slot ``k`` shaped like the dataset's chunks.

        Every view keeps one fresh numpy array alive, the owner of the slot's bytes; ``on_release`` runs in the
        first ``reclaim()`` after the last view (or any view derived from it) is gone, which is when the ring slot
        may be overwritten (NOTE [ Reclaimed ring slots ]).
        """
        owner = self.memory.numpy_view(k * self.slot_bytes, self.slot_bytes)
        if on_release is not None:
            # No callback: the owner's death runs no code of ours (NOTE [ Reclaimed ring slots ]).
            ref = weakref.ref(owner)
            _HANDED[id(ref)] = (ref, on_release)
        # Each view is cut in numpy (an array over the owner's buffer keeps the owner as its base; one constructor
        # call, a third of a slice, view and reshape) and then wrapped by torch: a quarter of the cost of slicing and
        # viewing a torch tensor of the owner, per field and batch.
        batch: list[dict[str, torch.Tensor]] = [{} for _ in range(self.layout.num_groups)]
        for group, key, start, np_dtype, torch_dtype, shape in self._cuts:
            field = torch.from_numpy(np.ndarray(shape, np_dtype, owner, start))
            batch[group][key] = field if torch_dtype is None else field.view(torch_dtype)
        batch[0][INDEX_KEY] = torch.from_numpy(np.ndarray((self.bs,), np.int64, owner, self.index_offset))
        return batch

    def _words(self, offset: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        return self.memory.numpy_view(offset, nbytes).view(np.int64)

    def close(self) -> None:
        self._regions.clear()
        self._versions.clear()
        self._origins.clear()
        self._targets.clear()
        self.seq = np.empty(0, dtype=np.int64)
        self.announcements = self.returns = SlotQueue(np.zeros(1, dtype=np.int64), 0)
        self.memory.close()
