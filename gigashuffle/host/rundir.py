"""The per-user runtime directory, where attach sockets, the embedded server's socket and the node secret live.

The directory is private (0700, owned by this uid); one with another owner or looser modes is refused rather
than used, since a socket there hands out the training data.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from pathlib import Path

from gigashuffle.errors import GigashuffleError
from gigashuffle.host.pids import pid_alive


def runtime_dir() -> Path:
    """``$GIGASHUFFLE_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/gigashuffle``, else ``/tmp/gigashuffle-<uid>``; made
    private if missing."""
    path = runtime_dir_path()
    _ensure_private_dir(path)
    return path


def runtime_dir_path() -> Path:
    """Where ``runtime_dir()`` is, without making it: for cleanups, which have nothing to remove from a directory
    that is gone (a zygote that outlived a test's directory made it again, empty)."""
    explicit = os.environ.get("GIGASHUFFLE_RUNTIME_DIR")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "gigashuffle"
    return Path("/tmp") / f"gigashuffle-{os.getuid()}"


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


def attach_socket_path(pid: int, directory: Path | None = None) -> Path:
    return (directory or runtime_dir()) / f"attach-{pid}.sock"


def trainer_socket_path(directory: Path | None = None) -> Path:
    """A new attach socket path for this trainer process, one per loader (NOTE [ The trainer holds the buffer ] in
    trainer/nodetable.py): ``attach-<pid>-t<id>.sock``."""
    return (directory or runtime_dir()) / f"attach-{os.getpid()}-t{uuid.uuid4().hex[:8]}.sock"


def trainer_sockets(pid: int, directory: Path | None = None) -> list[Path]:
    """The attach sockets of trainer process ``pid`` (``trainer_socket_path``) found in the runtime directory."""
    return sorted((directory or runtime_dir()).glob(f"attach-{pid}-t*.sock"))


def remove_socket(path: Path) -> None:
    """Remove a socket file if it is there; a missing one is fine, anything else is an error."""
    try:
        path.unlink()
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise


def remove_stale_sockets(directory: Path | None = None) -> list[Path]:
    """Remove attach sockets whose process is gone (killed processes cannot remove their own): a child's
    ``attach-<pid>.sock`` and a trainer's ``attach-<pid>-t<id>.sock``."""
    removed = []
    for path in (directory or runtime_dir()).glob("attach-*.sock"):
        pid_text = path.stem.removeprefix("attach-").split("-", 1)[0]
        if pid_text.isdigit() and not pid_alive(int(pid_text)):
            remove_socket(path)
            removed.append(path)
    return removed
