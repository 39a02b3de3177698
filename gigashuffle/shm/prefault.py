"""Faulting memory in before a section that must be short: a checkpoint's pause (NOTE [ Checkpoint cut ]).

NOTE [ Faulting in before the pause ]
A page is first touched through a page fault: for a fresh anonymous page the kernel zeroes it, for a page of the
shared buffer it maps the page cache's page into this process. Inside the cut's pause both are pure waste for the
node: on the 2-core VM of docs/benchmarks.md a fresh 413 MB array took 1.06 s to fill the first time (0.84 s of
it in the kernel: guest memory the host had not backed yet) and 51-65 ms later in the same process, and a first
random gather from a new mapping of a 16 MB buffer 1-2 ms more than the next one. ``madvise(MADV_POPULATE_WRITE /
MADV_POPULATE_READ)`` (Linux 5.14) faults a range in with one call, before the pause, without touching the bytes
(ctypes releases the GIL meanwhile). On an older kernel ``EINVAL`` says so, and a write of one byte per page (zeros
into fresh memory) or a strided read does the same work in numpy.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
from typing import Any

import numpy as np
import numpy.typing as npt

_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE


def _madvise() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()
_unsupported: set[int] = set()  # advice the kernel refused with EINVAL once: not asked again


def _populate(address: int, nbytes: int, advice: int) -> bool:
    """Ask the kernel to fault ``[address, address + nbytes)`` in; False when it cannot (old kernel)."""
    if advice in _unsupported or nbytes <= 0:
        return False
    start = address - address % _PAGE
    length = (address + nbytes - start + _PAGE - 1) // _PAGE * _PAGE
    if _MADVISE(start, length, advice) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:  # the kernel does not know the advice
        _unsupported.add(advice)
    return False


def fault_in_for_write(array: npt.NDArray[Any]) -> None:
    """Back a fresh, contiguous ``array`` with pages now (their contents stay undefined, as ``np.empty``'s)."""
    if not _populate(array.ctypes.data, array.nbytes, _MADV_POPULATE_WRITE):
        flat = array.reshape(-1).view(np.uint8)
        flat[::_PAGE] = 0  # one byte per page faults the page in


def fault_in_for_read(array: npt.NDArray[Any]) -> None:
    """Map every page of a contiguous ``array`` (a view of shared memory) into this process now, reading no byte
    of it (the fallback reads one byte per page)."""
    if not _populate(array.ctypes.data, array.nbytes, _MADV_POPULATE_READ):
        flat = array.reshape(-1).view(np.uint8)
        int(flat[::_PAGE].sum(dtype=np.uint64))  # one byte per page
