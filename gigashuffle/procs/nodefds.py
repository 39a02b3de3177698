"""The node buffer's fds, from any process that serves them (NOTE [ Attach ] in procs/attach.py): the processes
Redis lists first, then a fallback the caller gives (a served buffer Redis forgot, in a child).

Apart from ``procs/attach.py``, whose client imports nothing of the package beyond it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from gigashuffle.control.plane import ControlPlane
from gigashuffle.errors import AttachError
from gigashuffle.procs.attach import attach
from gigashuffle.procs.chores import Backoff


def fetch_node_fds(
    store: ControlPlane, queue: str, timeout_s: float, fallback: Callable[[], tuple[int, int] | None] | None = None
) -> tuple[int, int]:
    """The node buffer's memfd and its slot table's, from any process that serves them (the caller closes them).
    ``fallback`` is asked after each round that Redis's list of processes did not answer (it may raise)."""
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(cap_s=0.05)
    errors: list[str] = []
    while True:
        fds = _fds_from_listed(store, errors)
        if fds is None and fallback is not None:
            fds = fallback()
        if fds is not None:
            return fds
        if time.monotonic() > deadline:
            raise AttachError(f"no process serves the buffer of {queue!r}: {errors[-3:]}")
        backoff.sleep()


def _fds_from_listed(store: ControlPlane, errors: list[str]) -> tuple[int, int] | None:
    """One round through the processes Redis lists as serving the buffer."""
    for info in store.processes().values():
        path = info.get("attach")
        if not path:
            continue
        try:
            _info, fds = attach(path)
        except AttachError as exc:
            errors.append(str(exc))
            continue
        if len(fds) == 2:
            return fds[0], fds[1]
        for fd in fds:
            os.close(fd)
        errors.append(f"{path} sent {len(fds)} fds, not the buffer's and the slot table's")
    return None
