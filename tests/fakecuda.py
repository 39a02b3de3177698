"""A fake of ``gigashuffle.trainer.cudaops.CudaOps`` for machines without a GPU that models what the pinning code
can get wrong (NOTE [ GPU placement ] in gigashuffle/trainer/pinning.py):

* streams per device; an operation enqueued on a stream runs only when the stream is advanced (by the test, or a
  ``synchronize``); ``wait_stream`` makes the waiter advance the other stream to where it was when asked;
* a copy reads its source when it runs, not when it is enqueued (a DMA out of pinned memory), so a ring slot reused
  while its copy is in flight shows as torn or repeated rows; a copy out of memory that is not registered is staged
  at once and counted as a host sync (what CUDA does for pageable memory);
* events complete when the stream they were recorded on passes them (never recorded: complete);
* the current device and stream per thread; a context per device, made by the first call that touches it: calls
  that act on "the current device" (register, unregister, clearing the error) touch the thread's current device;
* ``cudaHostRegister``/``Unregister`` over ranges, with the per-thread last error they leave set on failure, which
  the user's next kernel launch (``launch_kernel``) raises unless it was cleared;
* failures: the next ``fail_copies`` copies raise ``copy_error`` (a CUDA OOM) before anything is queued, and a
  stream marked ``stuck`` (a collective waiting for a dead rank) never passes its queued work: a device or event
  synchronize over it would hang, so they fail the test instead, and ``wait`` with a timeout returns False;
* pinned host blocks of torch's caching allocator (``pinned_clone``), which are pinned memory as registered rings are.
Tensors "on the device" are CPU tensors made by ``copy``; ``on_device`` tells them apart.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from gigashuffle.trainer.cudaops import CudaOps, Event


class FakeStream:
    def __init__(self, device: int, name: str) -> None:
        self.device = device
        self.name = name
        self.ops: deque[tuple[tuple[int, int] | None, Callable[[], None]]] = deque()  # (source range, run)
        self.enqueued = 0
        self.done = 0
        self.stuck = False  # behind work that never ends (NCCL waiting for a dead rank): nothing queued runs
        self.priority = 0

    def enqueue(self, run: Callable[[], None], source: tuple[int, int] | None = None) -> int:
        self.ops.append((source, run))
        self.enqueued += 1
        return self.enqueued

    def advance_to(self, position: int) -> None:
        if self.stuck and self.done < position:
            raise AssertionError(f"waiting for {self!r}, which is stuck, would hang")
        while self.done < position:
            _source, run = self.ops.popleft()
            self.done += 1
            run()

    def advance(self) -> None:
        self.advance_to(self.enqueued)

    def __repr__(self) -> str:
        return f"<stream {self.name} on {self.device}: {self.done}/{self.enqueued}>"


class FakeEvent:
    def __init__(self, on_sync: Callable[[], None]) -> None:
        self.on_sync = on_sync
        self.stream: FakeStream | None = None
        self.position = 0

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.position

    def synchronize(self) -> None:
        self.on_sync()
        if self.stream is not None:
            self.stream.advance_to(self.position)


class FakeCuda(CudaOps):
    def __init__(self, devices: int = 2) -> None:
        self.devices = devices
        self.contexts: dict[int, int] = {}  # device -> contexts made on it (a process makes at most one)
        self.registered: dict[int, int] = {}  # ptr -> nbytes
        self.streams: list[FakeStream] = [FakeStream(i, f"default{i}") for i in range(devices)]
        self.fail_register = 0  # the error code the next registers return (0: they succeed)
        self.fail_unregister = 0
        self.last_error: dict[int, int] = {}  # thread id -> the runtime's last error, as CUDA keeps it per thread
        self.copies = 0
        self.host_syncs = 0  # synchronize, event.synchronize and pageable copies
        self.device_syncs = 0  # synchronize() of a whole device
        self.unregistered_in_flight = 0  # unregisters while a copy out of the range was queued
        self.consumers: list[tuple[int, FakeStream]] = []  # record_stream calls: (data_ptr, stream)
        self.fail_copies = 0  # how many of the next copies raise copy_error
        self.copy_error: Callable[[], BaseException] = lambda: RuntimeError("CUDA out of memory. Tried to allocate")
        self.copy_streams: dict[int, FakeStream] = {}  # copy_stream(): one per device, made once
        self.pinned_blocks: list[torch.Tensor] = []  # pinned_clone(): torch's host allocator keeps them
        self.timed_out_waits = 0
        self._device_ptrs: set[int] = set()
        self._local = threading.local()

    # -- the thread's current device and streams ---------------------------------------------------------------
    @property
    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def _touch(self, index: int) -> None:
        if not 0 <= index < self.devices:
            raise AssertionError(f"no device {index}")
        self.contexts.setdefault(index, 1)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.devices

    def guard(self, index: int) -> AbstractContextManager[object]:
        return self._guard(index)

    @contextmanager
    def _guard(self, index: int) -> Iterator[object]:
        self._touch(index)  # cudaSetDevice makes the device's context (CUDA 12)
        before = self.current_device
        self._local.device = index
        try:
            yield None
        finally:
            self._local.device = before

    def use_stream(self, stream: FakeStream) -> AbstractContextManager[object]:
        """``torch.cuda.stream(stream)``: the thread's current stream of the stream's device for the block."""
        return self._use_stream(stream)

    @contextmanager
    def _use_stream(self, stream: FakeStream) -> Iterator[object]:
        current = self._current_streams()
        before = current.get(stream.device)
        current[stream.device] = stream
        try:
            yield None
        finally:
            if before is None:
                del current[stream.device]
            else:
                current[stream.device] = before

    def _current_streams(self) -> dict[int, FakeStream]:
        if not hasattr(self._local, "streams"):
            self._local.streams = {}
        streams: dict[int, FakeStream] = self._local.streams
        return streams

    def has_context(self, index: int) -> bool:
        return index in self.contexts

    def new_stream(self, index: int) -> Any:
        self._touch(index)
        stream = FakeStream(index, f"side{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def current_device_index(self) -> int:
        return self.current_device

    def copy_stream(self, index: int) -> Any:
        if index not in self.copy_streams:
            stream = self.new_stream(index)
            stream.name, stream.priority = f"copy{index}", -1
            self.copy_streams[index] = stream
        return self.copy_streams[index]

    def current_stream(self, index: int) -> Any:
        self._touch(index)
        return self._current_streams().get(index, self.streams[index])

    def stream_device(self, stream: Any) -> int:
        return int(stream.device)

    def new_event(self) -> Event:
        return FakeEvent(self._host_sync)

    def record(self, event: Event, stream: Any) -> None:
        if not isinstance(event, FakeEvent) or not isinstance(stream, FakeStream):
            raise AssertionError("record takes a fake event and a fake stream")
        self._touch(stream.device)
        event.stream = stream
        event.position = stream.enqueued

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        position = stream.enqueued
        waiter.enqueue(lambda: stream.advance_to(position))

    # -- copies ---------------------------------------------------------------------------------------------------
    def copy(self, src: torch.Tensor, index: int, stream: Any) -> torch.Tensor:
        if stream.device != index:
            raise AssertionError(f"a copy to device {index} enqueued on {stream!r}")
        self._touch(index)
        if self.fail_copies:
            self.fail_copies -= 1
            raise self.copy_error()
        self.copies += 1
        dst = torch.full_like(src, 0x5A) if src.dtype == torch.uint8 else torch.zeros_like(src)
        self._device_ptrs.add(dst.untyped_storage().data_ptr())
        start = src.data_ptr()
        if self._registered_range(start, src.nbytes) is None:
            staged = src.clone()  # pageable: CUDA stages the source before the call returns, syncing the host
            self.host_syncs += 1
            stream.enqueue(lambda: dst.copy_(staged))
        else:
            # A DMA reads addresses: it holds no reference to the tensor (whose death releases the ring slot).
            raw = torch.frombuffer((ctypes.c_char * src.nbytes).from_address(start), dtype=torch.uint8)
            stream.enqueue(lambda: dst.view(torch.uint8).view(-1).copy_(raw), (start, src.nbytes))
        return dst

    def _host_sync(self) -> None:
        self.host_syncs += 1

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._device_ptrs

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self.consumers.append((tensor.data_ptr(), stream))

    def synchronize(self, index: int) -> None:
        self._touch(index)
        self.host_syncs += 1
        self.device_syncs += 1
        for stream in self.streams_of(index):
            stream.advance()

    def wait(self, event: Event, timeout_s: float) -> bool:
        """The GPU runs what the event waits for, unless that is behind a stuck stream: then the wait times out."""
        if not isinstance(event, FakeEvent) and hasattr(event, "events"):  # AllOf
            return all(self.wait(e, timeout_s) for e in event.events)
        assert isinstance(event, FakeEvent)
        if event.stream is not None and event.stream.stuck and not event.query():
            self.timed_out_waits += 1
            return False
        event.synchronize()
        return True

    def pinned_clone(self, src: torch.Tensor) -> torch.Tensor:
        self._touch(self.current_device)
        block = src.clone()
        self.pinned_blocks.append(block)  # kept, as torch's host allocator keeps a block until its copies ran
        return block

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self._registered_range(tensor.data_ptr(), tensor.nbytes) is not None

    def streams_of(self, index: int) -> list[FakeStream]:
        return [s for s in self.streams if s.device == index]

    def advance_all(self) -> None:
        """What the GPU does while the host is busy: every queued operation runs."""
        while any(s.done < s.enqueued for s in self.streams):
            for stream in self.streams:
                stream.advance()

    def in_flight(self) -> int:
        return sum(s.enqueued - s.done for s in self.streams)

    # -- registration and errors ----------------------------------------------------------------------------------
    def _registered_range(self, start: int, nbytes: int) -> int | None:
        """The start of the registered range or pinned block that holds ``[start, start + nbytes)``, or None."""
        for ptr, size in self.registered.items():
            if ptr <= start and start + nbytes <= ptr + size:
                return ptr
        for block in self.pinned_blocks:
            ptr = block.data_ptr()
            if ptr <= start and start + nbytes <= ptr + block.nbytes:
                return ptr
        return None

    def _fail(self, code: int) -> int:
        self.last_error[threading.get_ident()] = code
        return code

    def host_register(self, ptr: int, nbytes: int) -> int:
        self._touch(self.current_device)
        if self.fail_register:
            return self._fail(self.fail_register)
        if any(p < ptr + nbytes and ptr < p + n for p, n in self.registered.items()):
            return self._fail(712)
        self.registered[ptr] = nbytes
        return 0

    def host_unregister(self, ptr: int) -> int:
        self._touch(self.current_device)
        if self.fail_unregister:
            return self._fail(self.fail_unregister)
        if ptr not in self.registered:
            return self._fail(713)
        end = ptr + self.registered.pop(ptr)
        for stream in self.streams:
            for source, _run in stream.ops:
                if source is not None and ptr <= source[0] < end:
                    self.unregistered_in_flight += 1
        return 0

    def clear_error(self, index: int) -> None:
        self._touch(self.current_device)
        self.last_error.pop(threading.get_ident(), None)

    def launch_kernel(self) -> None:
        """The user's next kernel launch: torch checks ``cudaGetLastError`` after it and raises what it finds."""
        code = self.last_error.pop(threading.get_ident(), 0)
        if code:
            raise RuntimeError(f"CUDA error: {self.error_name(code)}")
