"""Framed messages with optional file descriptors over a connected AF_UNIX stream socket.

Used between a trainer and its own children (socketpairs that only our process tree holds, so pickle is safe
there) and, with JSON payloads, on the attach socket.

NOTE [ Per-batch messages ]
The doorbells ``BatchReady`` and ``FreeSlot`` (NOTE [ Slot queues ] in shm/slotqueue.py) may cross once per batch
each way, and each is always the same message. Pickling a dataclass costs a few microseconds (more than the send),
so ``send`` reuses the pickle of an equal message sent before and ``recv`` the object unpickled from an equal
payload before; both types are frozen (immutable, compared by value), so a shared instance is indistinguishable from
a fresh one. Other messages (contexts, states: arbitrary and possibly mutable objects) are pickled every time.
"""

from __future__ import annotations

import array
import math
import pickle
import select
import socket
import struct
import threading
from typing import Any

from gigashuffle.procs.interrupts import critical
from gigashuffle.procs.messages import BatchReady, FreeSlot

_HEADER = struct.Struct("<QB")  # payload length, number of fds
_MAX_FDS = 16
_REUSED = (BatchReady, FreeSlot)  # see NOTE [ Per-batch messages ]
_MAX_REUSED = 4096  # a bound on the caches below (ring slots are few; this only guards against misuse)
_pickled: dict[Any, bytes] = {}
_unpickled: dict[bytes, Any] = {}


class ChannelClosed(EOFError):
    """The peer closed its end (it exited or was killed)."""


class Channel:
    """One end of a message stream. ``send*`` may be called from several threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._poller = select.poll()
        self._polled_fd = -1  # the fd _poller watches (-1: none yet)

    @classmethod
    def pair(cls) -> tuple[Channel, Channel]:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls(a), cls(b)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_bytes(self, payload: bytes, fds: tuple[int, ...] = ()) -> None:
        if len(fds) > _MAX_FDS:
            raise ValueError(f"at most {_MAX_FDS} fds per message, got {len(fds)}")
        header = _HEADER.pack(len(payload), len(fds))
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        # A Ctrl-C between the two sends would leave the stream out of frame (NOTE [ Ctrl-C ] in procs/interrupts.py).
        with critical(), self._send_lock:
            # One syscall for the small messages of the hot path; sendall finishes what a full buffer cut off.
            sent = self.sock.sendmsg([header, payload], ancillary) - len(header)
            if sent < 0:
                self.sock.sendall(header[sent:])
                sent = 0
            if sent < len(payload):
                self.sock.sendall(payload[sent:])

    def recv_bytes(self) -> tuple[bytes, list[int]]:
        with critical():  # read whole or not at all: NOTE [ Ctrl-C ] in procs/interrupts.py
            return self._recv_message()

    def _recv_message(self) -> tuple[bytes, list[int]]:
        msg, ancillary, _flags, _addr = self.sock.recvmsg(_HEADER.size, socket.CMSG_SPACE(_MAX_FDS * 4))
        if not msg:
            raise ChannelClosed("peer closed the channel")
        fds: list[int] = []
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        header = msg + self._recv_exactly(_HEADER.size - len(msg))
        length, _count = _HEADER.unpack(header)
        return self._recv_exactly(length), fds

    def _recv_exactly(self, n: int) -> bytes:
        parts, left = [], n
        while left:
            part = self.sock.recv(min(left, 1 << 20))
            if not part:
                raise ChannelClosed("peer closed the channel mid-message")
            parts.append(part)
            left -= len(part)
        return b"".join(parts)

    def send(self, obj: Any, fds: tuple[int, ...] = ()) -> None:
        if type(obj) in _REUSED:
            payload = _pickled.get(obj)
            if payload is None:
                payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                if len(_pickled) < _MAX_REUSED:
                    _pickled[obj] = payload
        else:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.send_bytes(payload, fds)

    def recv(self) -> tuple[Any, list[int]]:
        payload, fds = self.recv_bytes()
        obj = _unpickled.get(payload)
        if obj is None:
            obj = pickle.loads(payload)
            if type(obj) in _REUSED and len(_unpickled) < _MAX_REUSED:
                _unpickled[payload] = obj
        return obj, fds

    def poll(self, timeout: float | None) -> bool:
        # A poll object registered once: half the cost of select.select, which builds its fd sets on every call
        # (several polls per batch on each side). Re-registered if the socket's fd changed; a closed socket goes
        # to select, which raises as before.
        fd = self.sock.fileno()
        if fd != self._polled_fd:
            if fd < 0:
                ready, _, _ = select.select([self.sock], [], [], timeout)
                return bool(ready)
            self._poller = select.poll()
            self._poller.register(fd, select.POLLIN)
            self._polled_fd = fd
        return bool(self._poller.poll(-1 if timeout is None else math.ceil(timeout * 1000)))

    def close(self) -> None:
        self.sock.close()
