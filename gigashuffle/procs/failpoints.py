"""Fail points: a SIGKILL, a Ctrl-C or a slow step at a named point of a process's cycle, for the tests of what a
death or an interrupt exactly there must not break (NOTE [ Lanes ] in shm/lanes.py). Off unless
``GIGASHUFFLE_FAILPOINTS`` is set, and then read once, when a process imports this module (the trainer; the zygote,
whose children inherit it); a call site costs one test of a module constant.

``GIGASHUFFLE_FAILPOINTS="<point>=<n>:<action>[,...]"``, ``<action>`` one of:
  * ``<marker path>``: the first process whose ``n``-th pass through ``<point>`` comes while the marker does not
    exist creates it and SIGKILLs itself (so a respawned child does not die again);
  * ``sleep=<seconds>[:<marker path>]``: the ``n``-th and every later pass is that slow (a slow step that a
    protocol must wait for, not a synchronisation); the marker, if given, is created at the first such pass, so a
    test can assert that the slow step happened;
  * ``error:<marker path>``: the ``n``-th and every later pass raises ``AttachError`` (a step that keeps failing);
    the marker is created at the first;
  * ``interrupt[=<seconds>]:<marker path>``: like the SIGKILL, once, but a SIGINT to itself (after sleeping that
    long, in which the process serves nothing: what its children sent meanwhile waits unread): a Ctrl-C there;
  * ``barrier:<directory>``: a meeting of ``n`` processes: each of the first ``n`` to pass leaves a file named by
    its pid in the directory and waits until there are ``n`` (at most ``BARRIER_WAIT_S``; a test asserts the
    count); later passes go on at once. It forces an interleaving that timing would hit only sometimes.
Points: ``writer.after_commit`` (rows committed, nothing else done yet), ``writer.before_publish`` (a writer made or
adopted a node buffer and offered it to the trainer, and is about to publish it), ``writer.after_publish`` (a
writer's publication of the node buffer won, before it registered, said ``Attached`` or committed a row),
``reader.after_release`` (a draw's slots released, its batches not yet announced), ``reader.before_attach`` (a reader
about to attach the node's buffer), ``cut.readers_asked`` (the trainer, in a checkpoint's cut, right after it asked its
readers to pause), ``trainer.map_table`` (the trainer about to map its slot table, from the fds a writer offered or
fetched through an attach), ``cut.before_buffer_list`` (a checkpoint's cut on local rank 0, every rank of the node
paused, before it lists the full slots of the node's buffer: NOTE [ Node cut ] in control/cutbarrier.py),
``cut.before_buffer_copy`` (the same rank, before it copies those slots: readers resumed in the saved-rows way, still
paused by positions).
"""

from __future__ import annotations

import logging
import os
import signal
import time

from gigashuffle.errors import AttachError

log = logging.getLogger(__name__)

_ENV = "GIGASHUFFLE_FAILPOINTS"
BARRIER_WAIT_S = 60.0


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
    count, action = armed
    if action.startswith("barrier:"):  # its count is of processes, not of passes
        _meet(action.removeprefix("barrier:"), count)
        return
    if _passes[point] < count:
        return
    if action.startswith("sleep="):
        seconds, _, marker = action.removeprefix("sleep=").partition(":")
        if marker and not os.path.exists(marker):
            _mark(marker)
        time.sleep(float(seconds))
        return
    if action.startswith("error:"):
        if not os.path.exists(marker := action.removeprefix("error:")):
            _mark(marker)
        raise AttachError(f"fail point {point}")
    interrupt = action.startswith("interrupt")
    delay, marker = action.removeprefix("interrupt").removeprefix("=").split(":", 1) if interrupt else ("", action)
    if not _mark(marker):
        return  # fired already (in a predecessor, or another child)
    if interrupt:
        time.sleep(float(delay or 0))
        log.warning("fail point %s: SIGINT pid %d", point, os.getpid())
        os.kill(os.getpid(), signal.SIGINT)
        return
    log.warning("fail point %s: SIGKILL pid %d", point, os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)


def _mark(marker: str) -> bool:
    """Create ``marker``; False if it existed."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def _meet(directory: str, processes: int) -> None:
    """Wait at a barrier of ``processes`` processes in ``directory`` (see the module's text)."""
    if len(os.listdir(directory)) >= processes:
        return  # met already: a later pass, or a respawned process
    _mark(os.path.join(directory, str(os.getpid())))
    deadline = time.monotonic() + BARRIER_WAIT_S
    while len(os.listdir(directory)) < processes and time.monotonic() < deadline:
        time.sleep(0.005)
