"""The attach socket: how a process of the node gets the buffer's fds and layout, once per process.

NOTE [ Attach ]
Every process that has the node buffer mapped serves it on ``<runtime dir>/attach-<pid>.sock`` (a path socket in
the private runtime directory, never the abstract namespace) and lists that path in the queue's ``procs`` hash.
A process that needs the buffer connects to any listed server; the server checks the peer's uid with
SO_PEERCRED, sends its info as JSON (the buffer's size, scope and metadata) and the buffer's and slot table's
memfds over SCM_RIGHTS, and closes. Since every holder serves, the owner (the process that allocated the buffer)
can die without stranding a respawned process, and a writer can find the buffer when Redis lists none (NOTE
[ A buffer Redis forgot ] in procs/forgottenbuffer.py). The trainer serves it too, on ``attach-<pid>-t<id>.sock``,
unlisted (NOTE [ The trainer holds the buffer ] in trainer/nodetable.py).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any

from gigashuffle.errors import AttachError
from gigashuffle.host.rundir import remove_socket
from gigashuffle.procs.channel import Channel, ChannelClosed

log = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.25  # how long close() may wait for the accept loop to notice


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


class AttachServer:
    """Serves ``fds`` and ``info`` to same-uid peers from a background thread until ``close()``."""

    def __init__(self, path: Path, fds: tuple[int, ...], info: dict[str, Any]) -> None:
        self.path = path
        self._fds = fds
        self._payload = json.dumps(info).encode()
        self._stop = threading.Event()
        remove_socket(path)  # a stale file from a killed process with our pid (pids are reused)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        os.chmod(path, 0o600)
        self._sock.listen(64)
        self._sock.settimeout(_ACCEPT_POLL_S)
        self._thread = threading.Thread(target=self._serve, name="gigashuffle-attach", daemon=True)
        self._thread.start()

    def set_info(self, info: dict[str, Any]) -> None:
        """What later peers get instead (one attribute swap: a peer gets the old info or the new, whole)."""
        self._payload = json.dumps(info).encode()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise
            with conn:
                if self._stop.is_set():
                    return  # close()'s own wake-up call
                conn.settimeout(5.0)
                if peer_uid(conn) != os.getuid():
                    log.warning("refused an attach from uid %d on %s", peer_uid(conn), self.path)
                    continue
                try:
                    Channel(conn).send_bytes(self._payload, self._fds)
                except OSError as exc:
                    log.debug("attach peer went away: %s", exc)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join()
        self._sock.close()
        remove_socket(self.path)

    def forget_in_fork(self) -> None:
        """In a fork's child: close this copy's listening socket; the parent's server, its thread and its socket
        file go on (close() here would unlink the file the parent serves on). The fds served are the caller's. No
        lock is taken: the child has no serving thread, and a parent thread may have held one at the fork."""
        self._sock.close()

    def _wake(self) -> None:
        """Connect once, so that the accept loop sees the stop now and not at its next poll: closing a loader waited
        up to ``_ACCEPT_POLL_S`` here (half of a later loader's whole life in the test suite)."""
        wake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        wake.settimeout(_ACCEPT_POLL_S)
        try:
            wake.connect(str(self.path))
        except OSError as exc:  # the loop still sees the stop at its next poll
            log.debug("could not wake the attach server at %s: %s", self.path, exc)
        finally:
            wake.close()


def attach(path: str | Path, timeout_s: float = 10.0) -> tuple[dict[str, Any], list[int]]:
    """Fetch the layout and fds from the server at ``path``; the fds are the caller's to close."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
        if peer_uid(sock) != os.getuid():
            raise AttachError(f"attach socket {path} belongs to uid {peer_uid(sock)}, not {os.getuid()}")
        payload, fds = Channel(sock).recv_bytes()
    except (OSError, ChannelClosed) as exc:
        raise AttachError(f"could not attach through {path}: {exc}") from exc
    finally:
        sock.close()
    if not fds:
        raise AttachError(f"attach server at {path} sent no file descriptor")
    return json.loads(payload), fds
