"""The messages a trainer and its children exchange over their private channel, one type each.

The channel is a socketpair that only the trainer's process tree holds, so these travel pickled (see
``procs/channel.py``); nothing read from Redis ever becomes one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["writer", "reader"]  # the two kinds of loader child

# -- child to trainer -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RingReady:
    """A reader's ring: its memfd travels with this message, once."""

    nbytes: int
    layout_json: str
    depth: int  # batches it holds (NOTE [ Ring depth ] in shm/buffer.py)


@dataclass(frozen=True)
class BatchReady:
    """Ring slots ``ks`` hold gathered batches, to be delivered in this order; the trainer answers ``FreeSlot``
    for each once the caller drops its batch. One message per draw of the reader, not per batch."""

    ks: tuple[int, ...]


@dataclass(frozen=True)
class Attached:
    """A writer has the node buffer and slot table mapped: from now on a lost session costs it nothing
    (NOTE [ Rejoining ] in ``trainer/supervisor.py``)."""


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


@dataclass(frozen=True)
class ChildError:
    """A child raised: the exception's type name and formatted traceback, sent before it exits."""

    type_name: str
    traceback: str


# -- trainer to child -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FreeSlot:
    """The caller dropped the batches in ring slots ``ks``: the reader may gather into them again."""

    ks: tuple[int, ...]


@dataclass(frozen=True)
class StartPass:
    number: int


@dataclass(frozen=True)
class SetContext:
    context: Any


@dataclass(frozen=True)
class LoadState:
    state: Any


@dataclass(frozen=True)
class StateRequest:
    request: int


@dataclass(frozen=True)
class Rejoin:
    """The trainer joined a new node session: quote ``generation`` from now on, register again, and publish the
    buffer's metadata (and the dummy row) again under it."""

    generation: str


ToTrainer = RingReady | Attached | BatchReady | PassEnd | DatasetState | ChildError
ToChild = FreeSlot | StartPass | SetContext | LoadState | StateRequest | Rejoin


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
