"""How much memory a new node buffer may take: the host's ``MemAvailable`` and this process's cgroup limits.

NOTE [ A buffer the node cannot hold ]
The node buffer is a memfd of ``shuffle_size`` rows; its pages are allocated as writers fill slots, not when it is
made. One larger than the memory the node can give never fails at allocation: it fails hours later, when the
buffer is nearly full, as an OOM kill of whichever process the kernel picks (often the trainer, the largest) or,
with swap, as a loader that slows to the disk's pace. So the writer that allocates the buffer first compares its
size with the memory available now (``available()``: the host's ``MemAvailable``, and for every memory cgroup of
this process up to the root, its limit less its usage that cannot be reclaimed, that is less its page cache)
and refuses a buffer larger than that with a ``ValueError`` that names ``shuffle_size``, the row size and
the figures; above ``WARN_SHARE`` of it, it warns. Swap does not count: a buffer read at random from swap delivers
a few thousand rows a second. The figure is a snapshot (other jobs may take memory later) and a lower bound where
memory could be reclaimed that ``MemAvailable`` does not count.
A checkpoint of the saved-rows way copies the buffer's full rows into local rank 0's trainer: arrays as large as
the full part of the buffer, made before the pause (checkpoint/savedrows.py). A copy larger than ``available()``
then got the trainer OOM-killed in ``state_dict()`` (a memory cgroup's OOM kill, SIGKILL, in
tests/integration/test_buffer_memory.py without the check); it now fails that checkpoint with a
``CheckpointError`` before the pause, saying to checkpoint by positions, and the loader goes on.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

WARN_SHARE = 0.8
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; v2 as "max"


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _read_int(path: Path) -> int | None:
    """A limit or usage file's value; None for none ("max", v1's huge value, a missing file)."""
    text = "".join(_lines(path)).strip()
    if not text.isdigit():
        return None
    value = int(text)
    return None if value >= _UNLIMITED else value


def _stat(path: Path) -> dict[str, int]:
    pairs = (line.partition(" ") for line in _lines(path))
    return {key: int(value) for key, _, value in pairs if value.strip().isdigit()}


def _mem_available(root: Path) -> int | None:
    for line in _lines(root / "proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _cgroup_dirs(root: Path) -> list[tuple[Path, int]]:
    """This process's memory cgroup directories, innermost first up to the mount's root, with their version."""
    found: list[tuple[Path, int]] = []
    for line in _lines(root / "proc/self/cgroup"):
        number, controllers, path = line.split(":", 2)
        if number == "0" and controllers == "":
            mount, version = root / "sys/fs/cgroup", 2
        elif "memory" in controllers.split(","):
            mount, version = root / "sys/fs/cgroup/memory", 1
        else:
            continue
        # Without a cgroup namespace the path is the host's, and the mount may show a cgroup below its root (a
        # container's): the longest tail of the path that exists under the mount is this process's cgroup.
        parts = [p for p in path.split("/") if p]
        leaf = next(
            (mount.joinpath(*parts[i:]) for i in range(len(parts)) if mount.joinpath(*parts[i:]).is_dir()), mount
        )
        while True:
            found.append((leaf, version))
            if leaf == mount:
                break
            leaf = leaf.parent
    return found


def _cgroup_room(directory: Path, version: int) -> int | None:
    """A cgroup's limit less its usage that cannot be reclaimed; None without a limit."""
    if version == 2:
        limit, usage = _read_int(directory / "memory.max"), _read_int(directory / "memory.current")
        stat, prefix = _stat(directory / "memory.stat"), ""
    else:
        limit, usage = _read_int(directory / "memory.limit_in_bytes"), _read_int(directory / "memory.usage_in_bytes")
        stat, prefix = _stat(directory / "memory.stat"), "total_"
    if limit is None:
        return None
    # Page cache is reclaimable, active or not; shared memory (the buffers) counts as anon, not file.
    cache = stat.get(f"{prefix}active_file", 0) + stat.get(f"{prefix}inactive_file", 0)
    return max(0, limit - max(0, (usage or 0) - cache))


def available(root: Path = Path("/")) -> tuple[int, str] | None:
    """The bytes a new buffer may take now and what bounds them (``MemAvailable`` or a cgroup's limit), or None
    when nothing says (no /proc)."""
    best: tuple[int, str] | None = None
    host = _mem_available(root)
    if host is not None:
        best = (host, "the host's MemAvailable")
    for directory, version in _cgroup_dirs(root):
        room = _cgroup_room(directory, version)
        if room is not None and (best is None or room < best[0]):
            best = (room, f"the limit of memory cgroup {directory} less its usage")
    return best


def gib(nbytes: int) -> str:
    """``nbytes`` as the messages give it."""
    return f"{nbytes / 2**30:.2f} GiB"


def refuse_a_buffer_too_large(nbytes: int, shuffle_size: int, row_bytes: int, queue: str) -> None:
    """Raise ``ValueError`` for a node buffer (rows and slot table: ``nbytes``) larger than the memory available
    now; warn above ``WARN_SHARE`` of it (NOTE [ A buffer the node cannot hold ])."""
    found = available()
    if found is None:
        return
    room, bound = found
    if nbytes > room:
        fits = int(shuffle_size * room / nbytes)
        raise ValueError(
            f"DataloaderConfig.shuffle_size={shuffle_size} is too large for this node: the buffer of queue "
            f"{queue!r} ({shuffle_size} rows of {row_bytes} B, with its slot table) needs {gib(nbytes)}, and "
            f"{bound} leaves {gib(room)}; once full it would get processes OOM-killed, or swap. Use "
            f"shuffle_size <= {fits}, or free memory on the node"
        )
    if nbytes > WARN_SHARE * room:
        log.warning(
            "queue %r: the node buffer (shuffle_size=%d rows of %d B with its slot table: %s) takes %.0f%% of the "
            "memory available now (%s, %s); the trainers and a checkpoint's copy of the buffer's rows (the default "
            "checkpoint_rows='saved') need memory too",
            queue, shuffle_size, row_bytes, gib(nbytes), 100 * nbytes / room, gib(room), bound,
        )  # fmt: skip
