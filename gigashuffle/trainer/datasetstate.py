"""The datasets' states in a rank's writers: collected for ``state_dict()``, handed back by ``load_state_dict()``.

Each writer holds its own copy of the dataset, so a checkpoint of a rank is the list of its writers' states in
writer order; it is only valid for a loader with the same rank layout (world size, rank, ``num_writers``).
"""

from __future__ import annotations

import time
from typing import Any

from gigashuffle.config import DataloaderConfig
from gigashuffle.errors import GigashuffleError
from gigashuffle.procs.messages import LoadState, StateRequest
from gigashuffle.trainer.supervisor import Supervisor

_REPLY_TIMEOUT_S = 60.0


def collect(sup: Supervisor, config: DataloaderConfig) -> dict[str, Any]:
    """Ask every writer of this rank for ``dataset.state_dict()`` and wait for all the answers."""
    while len(writers := sup.writers()) != config.num_writers:  # a respawning writer answers once it is back
        sup.pump()
    request = time.monotonic_ns()
    sup.states.clear()
    for child in writers:
        child.channel.send(StateRequest(request))
    deadline = time.monotonic() + _REPLY_TIMEOUT_S
    while any(sup.states.get(c.index) is None or sup.states[c.index].request != request for c in writers):
        if time.monotonic() > deadline:
            raise GigashuffleError(f"writers did not report their dataset state within {_REPLY_TIMEOUT_S}s")
        sup.pump()
    return {
        "global_rank": config.global_rank,
        "global_world_size": config.global_world_size,
        "num_writers": config.num_writers,
        "writers": [sup.states.pop(c.index).state for c in sorted(writers, key=lambda c: c.index)],
    }


def restore(sup: Supervisor, config: DataloaderConfig, state: dict[str, Any]) -> None:
    """Check that ``state`` was collected under this rank layout, then send each writer its own state; a writer
    started later (a respawn) gets it in its spec."""
    expected = {"global_world_size": config.global_world_size, "num_writers": config.num_writers,
                "global_rank": config.global_rank}  # fmt: skip
    for key, value in expected.items():
        if state.get(key) != value:
            raise ValueError(
                f"load_state_dict: the checkpoint has {key}={state.get(key)!r} but this loader has {value!r}; "
                "resume with the same world size and num_writers, and load each rank's own state"
            )
    sup.dataset_states = list(state["writers"])
    for child in sup.writers():
        child.channel.send(LoadState(state["writers"][child.index]))
