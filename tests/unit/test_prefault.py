"""NOTE [ Faulting in before the pause ] (shm/prefault.py): the pages are resident afterwards, with madvise and with
the fallback of an older kernel, and the bytes of the shared memory are unchanged."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from gigashuffle.shm import prefault
from gigashuffle.shm.buffer import SharedMemory

NBYTES = 8 << 20


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("madvise", [True, False])
def test_fault_in_makes_the_pages_resident(madvise: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not madvise:  # as on a kernel before 5.14, which answers EINVAL
        monkeypatch.setattr(prefault, "_unsupported", {prefault._MADV_POPULATE_READ, prefault._MADV_POPULATE_WRITE})
    # A fresh anonymous mapping: np.empty may reuse heap pages an earlier test of this worker left resident (the
    # fresh-clone run saw no growth at all), and those would show nothing about fault_in_for_write.
    mapping = mmap.mmap(-1, NBYTES)
    fresh = np.frombuffer(mapping, dtype=np.uint8).reshape(NBYTES // 64, 64)
    before = _resident()
    prefault.fault_in_for_write(fresh)
    assert _resident() - before >= NBYTES * 0.9

    written = SharedMemory(NBYTES)  # a writer's mapping of the buffer
    written.numpy_view(0, NBYTES)[:] = np.arange(NBYTES, dtype=np.uint64).astype(np.uint8)
    fd = os.dup(written.fd) if written.fd is not None else -1
    mine = SharedMemory(NBYTES, fd)  # the trainer's own, new mapping of it
    view = mine.numpy_view(0, NBYTES)
    before = _resident()
    prefault.fault_in_for_read(view)
    assert _resident() - before >= NBYTES * 0.9
    assert np.array_equal(view, np.arange(NBYTES, dtype=np.uint64).astype(np.uint8))
    mine.close()
    written.close()
    del fresh
    mapping.close()
