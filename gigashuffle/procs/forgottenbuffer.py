"""Finding the node's buffer through the runtime directory, when Redis no longer lists it.

NOTE [ A buffer Redis forgot ]
Redis lists the node buffer (its signed metadata, and the attach sockets of the processes that serve it). A Redis
that restarted empty, was flushed, or came back from an older snapshot lists nothing, while the buffer lives on
in the memory of the processes that map it. The trainers that mapped its slot table publish the metadata again
when they rejoin (NOTE [ Rejoining ] in trainer/rejoin.py), but a writer may start before any of them has: one of a
rank whose children were all still starting, or of a rank started while the others' trainers have not noticed
yet. Finding no metadata, it would allocate a second buffer, and the node's ranks would then read from two.

So before a writer allocates a buffer, it asks the attach sockets in the runtime directory (this user's, on this
machine) whether one of them serves a buffer of the same scope: the same Redis URL, queue and node id. Every
process that serves a published buffer says its scope and the buffer's metadata (unsigned) in its attach reply;
one that just allocated a buffer says its scope only once its publication won, since a losing buffer is dropped
(and, for the same reason, never listed in Redis). It also says its trainer (pid and start time): a buffer whose
processes outlive their trainer (for the poll interval in which the zygote notices a SIGKILLed trainer) is a
previous run's, and a new run (a resume) must never adopt it, so one whose trainer is gone is passed over. A writer
that finds one maps that buffer and its slot table,
signs the metadata under the current session and publishes it as a new buffer's would be: the first publication
wins, a loser attaches to the winner's through Redis as before, and the same metadata published again counts as
the owner's retry and wins too. Only a writer that finds none, or one that does not fit its configuration
(another slot count), allocates. Two writers that look at the same moment both find the live buffer, or both
find none and the publication picks one, as at any start.

What stays trusted: the attach socket checks its peer's uid (NOTE [ Attach ] in procs/attach.py), so the metadata comes
from a process of this user, as the node secret that signs it does. A URL written two ways (``localhost`` and
``127.0.0.1``) gives two scopes: such ranks find nothing locally and behave as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gigashuffle.errors import AttachError
from gigashuffle.host.pids import parent_of, process_start
from gigashuffle.procs.attach import attach

log = logging.getLogger(__name__)

# How long one attach socket may take to answer the search (a stopped process's never does).
_ASK_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class ServedBuffer:
    """A node buffer another process serves: its metadata fields (unsigned) and fds of the buffer and the table."""

    fields: dict[str, bytes]
    buffer_fd: int
    table_fd: int


def buffer_scope(redis_url: str, queue: str, node: str) -> str:
    """What makes two processes' buffers the same one: the Redis they coordinate through, the queue and the node."""
    key = "\0".join((redis_url, queue, node)).encode()
    return hashlib.sha256(key).hexdigest()[:32]


def trainer_of_this_child() -> tuple[int, int]:
    """(pid, start time) of the trainer of this loader child: its zygote's parent (NOTE [ Why a zygote ])."""
    trainer = parent_of(os.getppid())
    return trainer, process_start(trainer)


def attach_info(
    scope: str | None, nbytes: int, fields: dict[str, bytes], trainer: tuple[int, int] | None = None
) -> dict[str, Any]:
    """What a process that serves the buffer says in its attach reply (JSON: the fields' bytes as hex). Without
    ``scope`` the buffer is not found by :func:`find_served_buffer`: one whose publication may yet lose. With
    ``trainer`` (pid, start time) it is found only while that trainer lives."""
    info: dict[str, Any] = {"nbytes": nbytes, "fields": {name: value.hex() for name, value in fields.items()}}
    if trainer is not None:
        info["trainer"] = list(trainer)
    if scope is not None:
        info["scope"] = scope
    return info


def find_served_buffer(runtime_dir: Path, scope: str) -> ServedBuffer | None:
    """A buffer of ``scope`` that a process of this user on this machine serves, or None."""
    for path in sorted(runtime_dir.glob("attach-*.sock")):
        try:
            info, fds = attach(path, timeout_s=_ASK_TIMEOUT_S)
        except AttachError as exc:  # a stale socket of a dead process, or one that does not answer
            log.debug("no answer from %s: %s", path, exc)
            continue
        if info.get("scope") == scope and not _trainer_alive(info.get("trainer")):
            log.info("not adopting the buffer served at %s: its loader's trainer is gone (a previous run's)", path)
        elif info.get("scope") == scope and len(fds) == 2 and isinstance(info.get("fields"), dict):
            fields = {name: bytes.fromhex(value) for name, value in info["fields"].items()}
            log.info("found the node buffer of this queue served at %s", path)
            return ServedBuffer(fields, fds[0], fds[1])
        for fd in fds:
            os.close(fd)
    return None


def _trainer_alive(trainer: Any) -> bool:
    """Whether the trainer an attach reply names still runs (a reply that names none: yes, as before the field)."""
    if trainer is None:
        return True
    if not (isinstance(trainer, list) and len(trainer) == 2 and all(isinstance(v, int) for v in trainer)):
        return False
    pid, start = trainer
    return bool(start != 0 and process_start(pid) == start)
