"""The trainer's messages to a writer, applied between chunks and wherever it waits: a training context, an epoch,
a loaded state (``LoadState``), ``Go``, a state request (which a checkpoint's cut may make a pause), ``Resume`` and
``Rejoin``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from gigashuffle.procs.childenv import ChildEnv
from gigashuffle.procs.messages import DatasetState, Go, LoadState, Rejoin, Resume, SetContext, SetEpoch, StateRequest
from gigashuffle.procs.positions import Track
from gigashuffle.procs.resume import StreamPosition

log = logging.getLogger(__name__)

# How long an idle (or paused, or held) writer waits on its channel before it looks again.
IDLE_POLL_S = 1.0


class Chunks(Protocol):
    """The writer's chunks (``procs/chunks.py``), as far as its messages act on them. A protocol, since the chunks'
    idle wait applies these messages, so that module imports this one."""

    position: StreamPosition
    track: Track
    before_restart: Callable[[], None]

    def restart(self) -> None: ...


def handle_control(env: ChildEnv, chunks: Chunks) -> bool:
    """Apply the trainer's messages; True if one may change what the dataset yields (a context or a state). Paused
    by a checkpoint's cut, it returns only after ``Resume`` (NOTE [ Checkpoint cut ] in checkpoint/cut.py)."""
    changed = False
    position = chunks.position
    while env.channel.poll(IDLE_POLL_S if position.paused else 0) or position.paused:
        if env.channel.poll(0):
            message, _ = env.channel.recv()
            changed = _apply(env, chunks, message) or changed
        elif env.table is not None and (repaired := env.table.repair()):
            log.info("returned %d slots of dead processes", repaired)
    return changed


def _apply(env: ChildEnv, chunks: Chunks, message: Any) -> bool:
    dataset, position = env.spec.dataset, chunks.position
    if isinstance(message, SetContext):
        dataset.context = message.context
        return True
    if isinstance(message, SetEpoch):
        dataset.set_epoch(message.epoch)
        return True
    if isinstance(message, LoadState):
        point = message.point
        chunks.before_restart()
        dataset.load_state_dict(point.state)
        chunks.restart()
        # A filter takes the skip in (procs/positions.py) before the lane's base is set from it.
        skip = chunks.track.restart(point.base, point.state, point.keep, point.until, point.skip)
        position.restart(point.state, skip, point.serial)
        position.restore_rows = point.rows if len(point.rows) else None
        position.restored = 0
        env.spec.go = True
        return True
    if isinstance(message, Go):
        env.spec.go = True
    elif isinstance(message, StateRequest):
        if message.pause:
            chunks.before_restart()  # every row copied is published: the cut finds it full in the buffer
            position.paused = True
        state, skip = position.answer(dataset)
        where = chunks.track.answer(position.started, position.produced, skip, position.done)
        env.channel.send(DatasetState(message.request, env.spec.index, state, skip, position.leftover(), where))
    elif isinstance(message, Resume):
        position.paused = False
    elif isinstance(message, Rejoin):
        env.rejoin(message.generation)
    else:
        log.warning("writer %d ignores an unexpected %s", env.spec.index, type(message).__name__)
    return False
