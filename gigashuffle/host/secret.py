"""The node secret and the HMACs made with it: what lets a process trust what it reads back from Redis."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
from pathlib import Path

from gigashuffle.errors import GigashuffleError
from gigashuffle.host.rundir import runtime_dir

_SECRET_BYTES = 32


def node_secret(directory: Path | None = None) -> bytes:
    """A random key shared by this user's processes on this machine, for HMACs over what Redis stores.

    Many processes may ask for it at once on a fresh directory (every rank and child of a node starts together).
    The key is written whole to a private temporary file first and then ``os.link``-ed into place: ``link`` fails
    if the name exists, so exactly one candidate wins and nobody can ever read a partly written key. A loser
    reads the winner's complete file.
    """
    directory = directory or runtime_dir()
    path = directory / "secret"
    if not path.exists():
        _publish_secret(directory, path)
    secret = path.read_bytes()
    if len(secret) != _SECRET_BYTES:  # only a file made by something else (or truncated by hand) looks like this
        raise GigashuffleError(
            f"node secret {path} is incomplete ({len(secret)} of {_SECRET_BYTES} bytes); remove it and restart"
        )
    return secret


def _publish_secret(directory: Path, path: Path) -> None:
    candidate = directory / f".secret-{os.getpid()}-{os.urandom(8).hex()}"
    fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(_SECRET_BYTES))
        with contextlib.suppress(FileExistsError):  # another process published first: its key is the node's
            os.link(candidate, path)
    finally:
        candidate.unlink()  # the published name (ours or the winner's) keeps its own link to the key


def sign(secret: bytes, *parts: bytes) -> str:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.hexdigest()


def verify(secret: bytes, signature: bytes | str, *parts: bytes) -> bool:
    expected = sign(secret, *parts)
    given = signature.decode() if isinstance(signature, bytes) else signature
    return hmac.compare_digest(expected, given)
