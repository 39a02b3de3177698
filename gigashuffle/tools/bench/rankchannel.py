"""The JSON-lines channel between ``gigashuffle bench`` and a rank process it started (the messages are listed in
:mod:`.ranks`), with a deadline on every receive so that neither side waits forever for a peer that is gone.
"""

from __future__ import annotations

import json
import os
import select
import time
from collections.abc import Callable
from typing import Any

# A wait for a message wakes up this often to notice that the peer process died (a pipe can outlive it).
_PEER_CHECK_S = 0.5

Message = dict[str, Any]


class PeerGone(RuntimeError):
    """The other end of a rank channel closed it, died, or did not answer in time."""


class LineChannel:
    """JSON lines over a pair of pipe file descriptors, with a deadline on every receive."""

    def __init__(self, read_fd: int, write_fd: int, peer: str, peer_alive: Callable[[], bool] | None = None) -> None:
        self._read_fd = read_fd
        self._write_fd = write_fd
        self._peer = peer
        self._peer_alive = peer_alive
        self._buffer = b""

    def send(self, message: Message) -> None:
        data = json.dumps(message).encode() + b"\n"
        try:
            while data:
                data = data[os.write(self._write_fd, data) :]
        except BrokenPipeError as exc:
            raise PeerGone(f"{self._peer} is gone (broken pipe)") from exc

    def receive(self, deadline: float, waiting_for: str) -> Message:
        """The next message; ``PeerGone`` when the peer closed its end, died, or ``deadline`` (monotonic) passed."""
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerGone(f"{self._peer}: no {waiting_for} before the deadline")
            readable, _, _ = select.select([self._read_fd], [], [], min(remaining, _PEER_CHECK_S))
            if readable:
                data = os.read(self._read_fd, 1 << 16)
                if not data:
                    raise PeerGone(f"{self._peer} closed its end while we waited for {waiting_for}")
                self._buffer += data
            elif self._peer_alive is not None and not self._peer_alive():
                raise PeerGone(f"{self._peer} exited while we waited for {waiting_for}")
        line, _, self._buffer = self._buffer.partition(b"\n")
        message: Message = json.loads(line)
        return message
