"""A TCP proxy in front of a real Redis that loses replies (the server executes a command, the client never hears
back), and that can be moved to another server, as a failover moves a virtual address.

That is the one fault a pause shorter than the socket timeout never produces, and the one that makes redis-py
retry a call the server already ran (a Lua script included). The proxy forwards every request; for every
``every``-th request while armed, it marks the connection so that, when the server's reply arrives, it closes
both sides instead of forwarding it. The mark is set *before* the request is forwarded, so the reply can never
slip through first. redis-py sends one command per round trip on a connection (no pipelining here), so "the
next reply on this connection" is the reply to that command. ``redirect(port)`` cuts every open connection and
sends new ones to another server: what clients see when Sentinel or an operator fails a primary over to a
replica behind the same address.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import Counter
from types import TracebackType
from typing import Self

from redis_servers import LOOPBACK

_CHUNK = 1 << 16
# What redis-py sends on every new connection: losing these replies only fails the connection attempt, and
# counting them would make a fixed ``every`` fail every attempt alike.
_HANDSHAKE = frozenset({"HELLO", "CLIENT", "AUTH", "SELECT", "READONLY"})


class ReplyDropper:
    """Proxy ``127.0.0.1:<port>`` -> ``target``; ``arm(every)`` starts losing replies, ``disarm()`` stops."""

    def __init__(self, target_port: int, target_host: str = LOOPBACK) -> None:
        self._target = (target_host, target_port)
        self._listener = socket.create_server((LOOPBACK, 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._every = 0
        self._seen = 0
        self.dropped: Counter[str] = Counter()  # command name -> replies lost
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()
        self._accept_thread = threading.Thread(target=self._accept, name="reply-dropper", daemon=True)
        self._accept_thread.start()

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def arm(self, every: int) -> None:
        with self._lock:
            self._every, self._seen = every, 0

    def disarm(self) -> None:
        with self._lock:
            self._every = 0

    def redirect(self, target_port: int, target_host: str = LOOPBACK) -> None:
        """New connections go to ``target``; the open ones are cut (their clients reconnect, to the new target)."""
        with self._lock:
            self._target = (target_host, target_port)
            sockets = list(self._sockets)
            self._sockets.clear()
        self._close(*sockets)

    # -- plumbing ------------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                target = self._target
            try:
                server = socket.create_connection(target, timeout=5.0)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            client.settimeout(None)
            state = {"drop": ""}
            with self._lock:
                self._sockets.update((client, server))
            for target, args in ((self._requests, (client, server, state)), (self._replies, (server, client, state))):
                thread = threading.Thread(target=target, args=args, daemon=True)
                thread.start()
                self._threads.append(thread)

    def _requests(self, client: socket.socket, server: socket.socket, state: dict[str, str]) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(_CHUNK):
                name = _command_name(data) if data.startswith(b"*") else ""  # not a continuation chunk
                if name and name not in _HANDSHAKE:
                    with self._lock:
                        self._seen += 1
                        if self._every and self._seen % self._every == 0:
                            state["drop"] = name
                server.sendall(data)
        self._close(client, server)

    def _replies(self, server: socket.socket, client: socket.socket, state: dict[str, str]) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(_CHUNK):
                if state["drop"]:
                    with self._lock:
                        self.dropped[state["drop"]] += 1
                    break  # executed by the server, never heard of by the client
                client.sendall(data)
        self._close(client, server)

    def _close(self, *sockets: socket.socket) -> None:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._accept_thread.join(timeout=5.0)
        with self._lock:
            sockets = list(self._sockets)
        self._close(*sockets)
        for thread in self._threads:
            thread.join(timeout=5.0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


def _command_name(request: bytes) -> str:
    """``EVALSHA`` from ``*3\\r\\n$7\\r\\nEVALSHA\\r\\n...`` (best effort: the name is only for the report)."""
    parts = request.split(b"\r\n", 3)
    return parts[2].decode(errors="replace").upper() if len(parts) > 2 else "?"
