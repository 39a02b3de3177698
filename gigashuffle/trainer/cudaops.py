"""Every CUDA call the pinning code makes, in one object: ``CudaOps`` runs them with torch; the CPU tests replace it
with a fake that models devices, streams and copies in flight (tests/fakecuda.py), so that a wrong stream, a missing
device guard or a release before the copy fails a test on a machine without a GPU (NOTE [ GPU placement ] in
pinning.py).

The callers hold the device guard (``guard``): the calls here never pick a device themselves.
"""

from __future__ import annotations

import ctypes
import logging
import os
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, as torch's own pin_memory util registers
# The names of the errors a register or unregister of a ring gives in practice (cudaGetErrorName is not bound by
# torch; the message from cudaGetErrorString is added to the name).
_ERROR_NAMES = {
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    100: "cudaErrorNoDevice",
    712: "cudaErrorHostMemoryAlreadyRegistered",
    713: "cudaErrorHostMemoryNotRegistered",
    801: "cudaErrorNotSupported",
}


class Event(Protocol):
    """What the release queue needs of a ``torch.cuda.Event``."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class CudaOps:
    """The CUDA runtime as torch exposes it. ``Stream`` objects are ``torch.cuda.Stream``s, opaque to callers."""

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def guard(self, index: int) -> AbstractContextManager[object]:
        """Make ``index`` the current device of this thread for the block (torch's pin thread does the same)."""
        return torch.cuda.device(index)

    def has_context(self, index: int) -> bool:
        """Whether this process has a context on ``index`` (asking creates none)."""
        return bool(torch._C._cuda_hasPrimaryContext(index))  # type: ignore[attr-defined]

    def new_stream(self, index: int) -> Any:
        return torch.cuda.Stream(index)  # type: ignore[no-untyped-call]

    def current_stream(self, index: int) -> Any:
        return torch.cuda.current_stream(index)

    def new_event(self) -> Event:
        # blocking: a wait for a copy sleeps in the driver instead of spinning a core.
        return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]

    def record(self, event: Event, stream: Any) -> None:
        event.record(stream)  # type: ignore[attr-defined]

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        waiter.wait_stream(stream)

    def copy(self, src: torch.Tensor, index: int, stream: Any) -> torch.Tensor:
        """``src`` (host memory) copied to device ``index`` on ``stream``, allocated there; returns at once."""
        with torch.cuda.stream(stream):
            return src.to(torch.device("cuda", index), non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def synchronize(self, index: int) -> None:
        torch.cuda.synchronize(index)

    def host_register(self, ptr: int, nbytes: int) -> int:
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))  # type: ignore[no-untyped-call]

    def host_unregister(self, ptr: int) -> int:
        return int(torch.cuda.cudart().cudaHostUnregister(ptr))  # type: ignore[no-untyped-call]

    def clear_error(self, index: int) -> None:
        """Reset this thread's last CUDA error, which a failed runtime call leaves set for the next kernel launch
        of the user's (torch checks ``cudaGetLastError`` after each launch) to raise as its own."""
        lib = _libcudart()
        if lib is not None:
            lib.cudaGetLastError()
            return
        try:  # torch linked the runtime statically: let one tiny launch of ours take the error instead
            torch.zeros(1, device=torch.device("cuda", index))
        except RuntimeError as exc:
            log.debug("cleared the CUDA error state: %s", exc)

    def error_name(self, code: int) -> str:
        name = _ERROR_NAMES.get(code, f"cudaError {code}")
        try:
            return f"{name}: {torch.cuda.CudaError(code)}"
        except Exception:  # torch without CUDA bindings: the name is enough
            return name


def _libcudart() -> Any:
    """The CUDA runtime library this process already loaded (the instance torch calls), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only if already loaded
        except OSError:
            continue
    return None
