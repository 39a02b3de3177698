"""``SharedMemory``: one anonymous shared mapping, the memory of the node buffer, the reader rings and the slot table.

NOTE [ Shared memory without names ]
Every shared region is an anonymous ``memfd`` mapped ``MAP_SHARED``. It has no name in ``/dev/shm``, so a
killed process cannot leak one: the kernel frees the memory when the last fd and mapping of it go away. Other
processes get it by fd passing (SCM_RIGHTS, see ``procs/attach.py``), which is the mechanism torch's
``file_descriptor`` sharing strategy uses, without pickling tensors over the socket.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


class SharedMemory:
    """One anonymous shared mapping. ``fd`` stays open only while this process may hand it to others."""

    def __init__(self, nbytes: int, fd: int | None = None, name: str = "gigashuffle") -> None:
        if nbytes <= 0:
            raise ValueError(f"shared memory size must be positive, got {nbytes}")
        if fd is None:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
        file = os.fstat(fd)
        if file.st_size < nbytes:
            raise ValueError(f"shared memory fd {fd} holds {file.st_size} bytes, expected {nbytes}")
        self.nbytes = nbytes
        self.fd: int | None = fd
        self._file = (file.st_dev, file.st_ino)  # forget() finds the mapping's own fd by it
        # The mapping lives as long as any tensor made from it (torch keeps a reference to the exporter), so a
        # batch the caller still holds stays valid after close().
        self._map: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        # The fd is this object's from here on: closed by close_fd(), or when it is collected unclosed (the mapping
        # closes its own). Not at exit: the loader's teardown at exit still uses the slot table's fd after
        # weakref's exit pass would have run this newer finalizer (NOTE [ Loaders at exit ] in trainer/teardown.py).
        self._fd_finalizer = weakref.finalize(self, os.close, fd)
        self._fd_finalizer.atexit = False

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor over ``[offset, offset + nbytes)`` of the mapping."""
        if self._map is None:
            raise ValueError("shared memory is closed")
        import torch  # here, not at the top: the slot table and the node lock use this module without torch

        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)

    def numpy_view(self, offset: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        if self._map is None:
            raise ValueError("shared memory is closed")
        return np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=offset)

    def close_fd(self) -> None:
        if self.fd is not None:
            self.fd = None
            self._fd_finalizer()

    def close(self) -> None:
        """Drop this object's hold on the memory; live tensor views keep the mapping until they die."""
        self.close_fd()
        self._map = None

    def forget(self) -> None:
        """In a fork's child: drop this process's fd and mapping now, even under live views, leaving the memory to
        the processes that still use it (NOTE [ Forks of the trainer ] in trainer/forks.py). The views' addresses
        stay reserved, with nothing behind them: reading one faults, and no later mapping can land there."""
        self.close_fd()
        mapping, self._map = self._map, None
        if mapping is None:
            return
        try:
            mapping.close()
        except BufferError:  # views export it: close() would unmap under them
            _reserve_without_memory(mapping)
            _null_fds_of(self._file)  # the fd the mapping keeps of its own (a dup) holds the memory too


_MAP_FIXED, _MAP_NORESERVE, _PROT_NONE = 0x10, 0x4000, 0  # <sys/mman.h> on Linux (mmap exports neither before 3.13)


def _reserve_without_memory(mapping: mmap.mmap) -> None:
    """Replace ``mapping`` in place by an inaccessible anonymous one of the same size."""
    anchor = ctypes.c_char.from_buffer(mapping)  # an export for as long as this line needs its address
    address = ctypes.addressof(anchor)
    del anchor
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
    if _LIBC_MMAP(address, len(mapping), _PROT_NONE, flags, -1, 0) != address:
        raise OSError(ctypes.get_errno(), f"could not replace the shared mapping at {address:#x}")


def _null_fds_of(file: tuple[int, int]) -> None:
    """Point every fd of this process that refers to ``file`` (device, inode) at /dev/null: its number stays
    taken, so whoever closes it later closes /dev/null, never a file opened since under the same number."""
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                found = os.fstat(fd)
            except OSError:  # the listing's own fd, closed by now
                continue
            if (found.st_dev, found.st_ino) == file:
                os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


def _libc_mmap() -> Any:
    fn = ctypes.CDLL(None, use_errno=True).mmap
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fn.restype = ctypes.c_void_p
    return fn


_LIBC_MMAP = _libc_mmap()
