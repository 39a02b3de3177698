"""What /proc says about a process: alive, its state, who holds a flock, a one-line description for messages."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 on), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            text = stat_file.read()
    except OSError:
        return None
    return text[text.rindex(b")") + 2 :].split()


def process_start(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot, field 22 of ``/proc/<pid>/stat``), the identity that a reused
    pid does not share; 0 if there is no such process. A zombie still has one (as for ``pid_alive``): a process
    that is dying may yet commit or release slots, and its pid is not reused before it is reaped."""
    fields = _stat_fields(pid)
    return 0 if fields is None else int(fields[19])


def parent_of(pid: int) -> int:
    """``pid``'s parent (field 4 of ``/proc/<pid>/stat``); 0 if there is no such process."""
    fields = _stat_fields(pid)
    return 0 if fields is None else int(fields[1])


def pid_namespace() -> int:
    """The inode of this process's pid namespace: processes in other namespaces see other pids."""
    return os.stat("/proc/self/ns/pid").st_ino


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
