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
import time
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


_CUDA_STREAM_NON_BLOCKING = 1  # no implicit ordering with the legacy default stream (torch's own streams have it)
# The loader's copy stream of each device, made once per process (NOTE [ The copy stream ]).
_COPY_STREAMS: dict[int, Any] = {}


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

    def current_device_index(self) -> int:
        """The thread's current device (``torch.cuda.set_device``); asking makes no context."""
        return torch.cuda.current_device()

    def new_stream(self, index: int) -> Any:
        """A stream of torch's pool on ``index`` (the tests' side streams; the loader copies on ``copy_stream``)."""
        return torch.cuda.Stream(index)  # type: ignore[no-untyped-call]

    def copy_stream(self, index: int) -> Any:
        """The loader's own copy stream of device ``index`` (NOTE [ The copy stream ]); call under its guard."""
        stream = _COPY_STREAMS.get(index)
        if stream is None:
            stream = _COPY_STREAMS[index] = _dedicated_stream(index)
        return stream

    def current_stream(self, index: int) -> Any:
        return torch.cuda.current_stream(index)

    def stream_device(self, stream: Any) -> int:
        """The device index of a stream (a caller's, e.g. given to ``loader.release_after``)."""
        return int(stream.device_index)

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

    def wait(self, event: Event, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``event``; whether it completed. Polls rather than ``event.synchronize()``,
        which has no timeout: an event behind a collective waiting for a dead rank never completes."""
        deadline = time.monotonic() + timeout_s
        pause = 1e-4
        while not event.query():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.01)
        return True

    def pinned_clone(self, src: torch.Tensor) -> torch.Tensor:
        """A copy of ``src`` (host memory) in page-locked memory of torch's caching host allocator, which reuses a
        block only once the copies that read it are done; call under the device guard (the allocation may make
        a context on the current device)."""
        return torch.empty_like(src, pin_memory=True).copy_(src)

    def host_register(self, ptr: int, nbytes: int) -> int:
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))  # type: ignore[no-untyped-call]

    def host_unregister(self, ptr: int) -> int:
        return int(torch.cuda.cudart().cudaHostUnregister(ptr))  # type: ignore[no-untyped-call]

    def clear_error(self, index: int) -> None:
        """Reset this thread's last CUDA error, which a failed runtime call leaves set for the next kernel launch
        of the user's (torch checks ``cudaGetLastError`` after each launch) to raise as its own. It must be the
        runtime torch calls (``_torch_cudart``): another copy in the process (CuPy's, JAX's) keeps its own state."""
        lib = _torch_cudart()
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


# NOTE [ The copy stream ]
# ``torch.cuda.Stream(...)`` does not make a stream: it hands out one of a pool of 32 per device and priority, round
# robin, shared with every other ``torch.cuda.Stream()`` of the process (the user's side streams, DDP's, NCCL's).
# Copies queued on a pool stream then wait behind whatever else landed on it, and the loader's events there cover
# foreign work too. So the loader makes its own stream per device with the runtime torch uses
# (``cudaStreamCreateWithPriority``): non-blocking, as torch's own (no implicit order with the legacy default
# stream, on which the user's compute runs), at the greatest priority the device has, so that a copy queued while
# the GPU is busy starts first. It is made once per process and device and never destroyed: blocks of torch's
# caching allocator stay associated with it after the loader closes. Where the runtime cannot be found (a torch
# that linked it statically), the high-priority pool stream is the fallback: still off the default-priority pool
# that ``torch.cuda.Stream()`` draws from.


def _dedicated_stream(index: int) -> Any:
    lib = _torch_cudart()
    if lib is not None:
        try:
            least, greatest = ctypes.c_int(0), ctypes.c_int(0)
            if lib.cudaDeviceGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)) != 0:
                greatest = ctypes.c_int(0)
            handle = ctypes.c_void_p(0)
            create = lib.cudaStreamCreateWithPriority
            create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_int]
            if create(ctypes.byref(handle), _CUDA_STREAM_NON_BLOCKING, greatest) == 0 and handle.value:
                return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))  # type: ignore[no-untyped-call]
            lib.cudaGetLastError()  # the failed create must not surface at the user's next launch
        except (AttributeError, OSError, RuntimeError) as exc:
            log.debug("no dedicated copy stream on cuda:%d (%s): using torch's high-priority pool", index, exc)
    return torch.cuda.Stream(index, priority=-1)  # type: ignore[no-untyped-call]


def _torch_cudart() -> Any:
    """The CUDA runtime library torch itself calls, or None (linked statically). Looked up through torch's own CUDA
    library: ``dlsym`` on a library's handle searches it and then its dependencies, so the symbol found is the one
    torch's calls bind to, even when CuPy or JAX loaded another ``libcudart`` earlier in the process."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    try:  # RTLD_NOLOAD: only the copy already loaded, never a fresh one with its own state
        lib = ctypes.CDLL(os.path.join(lib_dir, "libtorch_cuda.so"), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None
    return lib if hasattr(lib, "cudaGetLastError") else None
