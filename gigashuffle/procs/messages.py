"""The messages a trainer and its children exchange over their private channel, one type each.

The channel is a socketpair that only the trainer's process tree holds, so these travel pickled (see
``procs/channel.py``); nothing read from Redis ever becomes one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gigashuffle.resumepoint import ResumePoint
from gigashuffle.rowblock import NO_ROWS, RowBlock

Role = Literal["writer", "reader"]  # the two kinds of loader child

# -- child to trainer -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RingReady:
    """A reader's ring: its memfd travels with this message, once."""

    nbytes: int
    layout_json: str
    depth: int  # batches it holds (NOTE [ Ring depth ] in shm/ring.py)


@dataclass(frozen=True)
class BatchReady:
    """A doorbell: the reader announced batches while the trainer waited for one (the ring slots are in the ring's
    announcements, not in the message: NOTE [ Slot queues ] in shm/slotqueue.py)."""


@dataclass(frozen=True)
class BufferOffer:
    """A writer is about to publish a node buffer (one it made, or one Redis forgot): the buffer's and the slot
    table's memfds travel with it, sent before the publication, so that the trainer has them whenever the writer
    dies after its publication won (NOTE [ The trainer holds the buffer ] in ``trainer/nodetable.py``). ``owner``:
    the buffer's ``owner`` metadata field, which names the buffer the published metadata is of."""

    owner: bytes


@dataclass(frozen=True)
class Attached:
    """A writer has the node buffer and slot table mapped: from now on a lost session costs it nothing
    (NOTE [ Rejoining ] in ``trainer/rejoin.py``). A writer of a stateful dataset sends the memfd of its
    commit counter with it (NOTE [ Respawned writers ] in ``procs/resume.py``)."""


@dataclass(frozen=True)
class Progress:
    """A writer's dataset state before a chunk: ``produced`` rows of its stream (since the state it started from,
    serial ``serial``) came before that chunk. Sent a few times a second, never per chunk: NOTE [ Respawned
    writers ]."""

    serial: int
    produced: int
    state: Any


@dataclass(frozen=True)
class MixShare:
    """A writer has written its share of the node's first mix, or found the node reading already
    (NOTE [ First mix ] in ``procs/firstmix.py``)."""


@dataclass(frozen=True)
class PassEnd:
    """A fill_once reader sent every batch of pass ``number``."""

    number: int


@dataclass(frozen=True)
class DatasetState:
    """A writer's ``dataset.state_dict()``, answering ``StateRequest(request)``."""

    request: int
    index: int
    state: Any
    skip: int = 0  # rows after ``state`` that were already written (NOTE [ Respawned writers ])
    rows: RowBlock = NO_ROWS  # a checkpoint's saved rows this writer had not yet put back (NOTE [ Checkpoint cut ])
    positions: Any = None  # NOTE [ Positions checkpoint ] in checkpoint/positions.py: procs/positions.py Track.answer


@dataclass(frozen=True)
class Paused:
    """A reader has announced every batch it drew and draws nothing until ``Resume`` (NOTE [ Checkpoint cut ]).
    ``cut`` is the number of the ``Pause`` it answers: a late answer to an aborted cut does not count for the next."""

    cut: int


@dataclass(frozen=True)
class ChildError:
    """A child raised: the exception's type name and formatted traceback, sent before it exits."""

    type_name: str
    traceback: str


# -- trainer to child -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FreeSlot:
    """A doorbell: the trainer gave ring slots back while the reader waited for one (the slots are in the ring's
    returns, not in the message: NOTE [ Slot queues ] in shm/slotqueue.py)."""


@dataclass(frozen=True)
class StartPass:
    number: int


@dataclass(frozen=True)
class SetContext:
    context: Any


@dataclass(frozen=True)
class SetEpoch:
    """Call ``dataset.set_epoch(epoch)`` in the writer (``loader.set_epoch``)."""

    epoch: int


@dataclass(frozen=True)
class LoadState:
    """``load_state_dict``: start again from ``point`` (its rows first, then its state, filter and skip, counted
    under its serial); also lets a writer that holds before its first rows go on (``Go``)."""

    point: ResumePoint


@dataclass(frozen=True)
class Go:
    """The trainer asked for its first batch (or restored a state): a writer that holds before committing its
    first rows goes on (NOTE [ Restore before reading ] in procs/resume.py)."""


@dataclass(frozen=True)
class StateRequest:
    """Answer ``DatasetState``; with ``pause``, first publish every copied row, answer for exactly the rows in the
    buffer, and write nothing more until ``Resume`` (NOTE [ Checkpoint cut ])."""

    request: int
    pause: bool = False


@dataclass(frozen=True)
class Pause:
    """A reader finishes the draw it has begun, answers ``Paused(cut)`` and draws nothing until ``Resume``."""

    cut: int  # the checkpoint's cut number (NOTE [ Node cut ] in control/cutbarrier.py)


@dataclass(frozen=True)
class Resume:
    """The checkpoint's cut is over: readers draw and writers write again."""


@dataclass(frozen=True)
class Rejoin:
    """The trainer joined a new node session: quote ``generation`` from now on, register again, and publish the
    buffer's metadata (and the dummy row) again under it."""

    generation: str


ToTrainer = (
    RingReady | BufferOffer | Attached | Progress | MixShare | BatchReady | Paused | PassEnd | DatasetState | ChildError
)
ToChild = FreeSlot | StartPass | SetContext | SetEpoch | LoadState | Go | StateRequest | Pause | Resume | Rejoin


# -- trainer and its zygote (NOTE [ Why a zygote ] in procs/zygote.py) ------------------------------------------


@dataclass(frozen=True)
class Spawn:
    """Trainer to zygote: fork a child running ``childmain.child_main(payload)``; the child's end of its channel
    travels with this message as the one fd."""

    seq: int  # the request number: the trainer names the child by it until its pid is known
    payload: bytes
    title: str


@dataclass(frozen=True)
class Kill:
    """Trainer to zygote: SIGKILL the child of request ``seq`` if it is still unreaped (its pid cannot have been
    reused then)."""

    seq: int


@dataclass(frozen=True)
class Release:
    """Trainer to zygote: the loader closed. Kill and reap every child, answer ``Released``, then wait for the next
    loader's preparation (NOTE [ Reused zygotes ] in procs/zygotereuse.py)."""


@dataclass(frozen=True)
class Released:
    """Zygote to trainer: every child of the loader it served is reaped; it waits for another loader."""


@dataclass(frozen=True)
class Prepared:
    """Zygote to trainer: a reused zygote took the new loader's preparation and forks for it now."""


@dataclass(frozen=True)
class Spawned:
    """Zygote to trainer: request ``seq`` runs as ``pid``."""

    seq: int
    pid: int


@dataclass(frozen=True)
class Exited:
    """Zygote to trainer: child ``pid`` was reaped with ``exitcode`` (negative: killed by that signal)."""

    pid: int
    exitcode: int


ZygoteEvent = Spawned | Exited


# The doorbells are always the same (NOTE [ Per-batch messages ] in procs/channel.py).
BATCH_DOORBELL = BatchReady()
SLOT_DOORBELL = FreeSlot()
