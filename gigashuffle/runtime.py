"""The per-user runtime directory: attach sockets, the embedded server's socket and the node secret.

The directory is private (0700, owned by this uid); one with another owner or looser modes is refused rather
than used, since a socket there hands out the training data.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import stat
from pathlib import Path

from .errors import GigashuffleError

_SECRET_BYTES = 32


def runtime_dir() -> Path:
    """``$GIGASHUFFLE_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/gigashuffle``, else ``/tmp/gigashuffle-<uid>``."""
    explicit = os.environ.get("GIGASHUFFLE_RUNTIME_DIR")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if explicit:
        path = Path(explicit)
    elif xdg and os.path.isdir(xdg):
        path = Path(xdg) / "gigashuffle"
    else:
        path = Path("/tmp") / f"gigashuffle-{os.getuid()}"
    _ensure_private_dir(path)
    return path


def _ensure_private_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=False)
    except FileExistsError:
        pass
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise GigashuffleError(
            f"runtime directory {path} must be a directory owned by uid {os.getuid()} with mode 0700 "
            f"(found uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}); remove it or set "
            "GIGASHUFFLE_RUNTIME_DIR to a private directory"
        )


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


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def flock_holder(fd: int) -> int | None:
    """The pid holding a ``flock`` on the file behind ``fd``, from ``/proc/locks``; None if no one (or unknown)."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as locks:
            for line in locks:
                # "1: FLOCK  ADVISORY  WRITE 1234 00:01:5678 0 EOF"; a waiter's line has "->" after the number
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key:
                    return int(parts[4])
    except (OSError, ValueError):
        return None
    return None


_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible I/O",
    "T": "stopped by a signal",
    "t": "stopped by a debugger",
    "Z": "a zombie",
}


def process_state(pid: int) -> str:
    """The one-letter state of ``pid`` from ``/proc/<pid>/stat`` (R, S, D, T, t, Z, ...); "" if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            text = stat_file.read()
    except OSError:
        return ""
    return text[text.rindex(")") + 2 :].split(maxsplit=1)[0]


def is_stopped(pid: int) -> bool:
    return process_state(pid) in ("T", "t")


def describe_process(pid: int) -> str:
    """``pid``, its command line and what it is doing, for messages about a process that keeps others waiting."""
    state = process_state(pid)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            name = " ".join(cmdline.read().decode(errors="replace").replace("\0", " ").split())[:80]
    except OSError:
        state = ""
    if not state:
        return f"pid {pid} (gone)"
    what = _STATES.get(state, f"state {state}")
    advice = ": send it SIGCONT, or kill it (the kernel drops a dead holder's lock)" if state in ("T", "t") else ""
    return f"pid {pid} ({name or '?'}), {what}{advice}"


def attach_socket_path(pid: int, directory: Path | None = None) -> Path:
    return (directory or runtime_dir()) / f"attach-{pid}.sock"


def remove_socket(path: Path) -> None:
    """Remove a socket file if it is there; a missing one is fine, anything else is an error."""
    try:
        path.unlink()
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise


def remove_stale_sockets(directory: Path | None = None) -> list[Path]:
    """Remove attach sockets whose process is gone (killed processes cannot remove their own)."""
    removed = []
    for path in (directory or runtime_dir()).glob("attach-*.sock"):
        pid_text = path.stem.removeprefix("attach-")
        if pid_text.isdigit() and not pid_alive(int(pid_text)):
            remove_socket(path)
            removed.append(path)
    return removed
