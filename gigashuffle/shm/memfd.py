"""``SharedMemory``: one anonymous shared mapping, the memory of the node buffer, the reader rings and the slot table.

NOTE [ Shared memory without names ]
Every shared region is an anonymous ``memfd`` mapped ``MAP_SHARED``. It has no name in ``/dev/shm``, so a
killed process cannot leak one: the kernel frees the memory when the last fd and mapping of it go away. Other
processes get it by fd passing (SCM_RIGHTS, see ``procs/attach.py``), which is the mechanism torch's
``file_descriptor`` sharing strategy uses, without pickling tensors over the socket.
"""

from __future__ import annotations

import mmap
import os
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
        import torch  # here, not at the top: the slot table and the node lock use this module without torch

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
