"""The messages a trainer and its children exchange over their private channel, one type each.

The channel is a socketpair that only the trainer's process tree holds, so these travel pickled (see
``procs/channel.py``); nothing read from Redis ever becomes one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
class SetEpoch:
    """Call ``dataset.set_epoch(epoch)`` in the writer (``loader.set_epoch``)."""

    epoch: int


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
ToChild = FreeSlot | StartPass | SetContext | SetEpoch | LoadState | StateRequest | Rejoin
