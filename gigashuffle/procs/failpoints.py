"""Fail points: a SIGKILL at a named point of a child's cycle, for the tests of what a death exactly there must not
break (NOTE [ Lanes ] in shm/lanes.py). Off unless ``GIGASHUFFLE_FAILPOINTS`` is set, and then read once, when the
zygote imports this module; a call site costs one test of a module constant.

``GIGASHUFFLE_FAILPOINTS="<point>=<n>:<marker path>[,...]"``: the first process whose ``n``-th pass through
``<point>`` comes while ``<marker path>`` does not exist creates it and SIGKILLs itself (so a respawned child does not
die again). ``<point>=<n>:sleep=<seconds>`` instead makes the ``n``-th and every later pass that slow (a slow step
that a protocol must wait for, not a synchronisation). Points: ``writer.after_commit`` (rows committed, nothing else
done yet), ``reader.after_release`` (a draw's slots released, its batches not yet announced),
``cut.before_buffer_list`` (a checkpoint's cut on local rank 0, every rank of the node paused, before it lists the
full slots of the node's buffer: NOTE [ Node cut ] in control/cutbarrier.py), ``cut.before_buffer_copy`` (the same
rank, readers resumed, writers held, before it copies those slots).
"""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger(__name__)

_ENV = "GIGASHUFFLE_FAILPOINTS"


def _parse(text: str) -> dict[str, tuple[int, str]]:
    points: dict[str, tuple[int, str]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            name, rest = item.split("=", 1)
            count, marker = rest.split(":", 1)
            points[name] = (int(count), marker)
        except ValueError:
            raise ValueError(
                f"{_ENV}: cannot read {item!r}; write <point>=<n>:<marker path>, e.g. "
                "reader.after_release=20:/tmp/fired"
            ) from None
    return points


_POINTS = _parse(os.environ.get(_ENV, ""))
ACTIVE = bool(_POINTS)  # call sites test this first
_passes: dict[str, int] = {}


def reached(point: str) -> None:
    """``point`` is passed: SIGKILL this process if it is the armed pass (see the module's text)."""
    armed = _POINTS.get(point)
    if armed is None:
        return
    _passes[point] = _passes.get(point, 0) + 1
    count, marker = armed
    if _passes[point] < count:
        return
    if marker.startswith("sleep="):
        time.sleep(float(marker.removeprefix("sleep=")))
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return  # fired already (in a predecessor, or another child)
    log.warning("fail point %s: SIGKILL pid %d", point, os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)
