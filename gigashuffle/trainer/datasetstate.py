"""The datasets' states in a rank's writers: collected for ``state_dict()``, handed back by ``load_state_dict()``.

Each writer holds its own copy of the dataset, so a checkpoint of a rank is the list of its writers' states in
writer order, plus for each how many rows after that state were already written (``skip``: a writer that was
respawned, or that has not yet re-read what it must not repeat: NOTE [ Respawned writers ] in procs/writer.py). It
is only valid for a loader with the same rank layout (world size, rank, ``num_writers``).

The state is keyed by rank, ``{"rank<global_rank>": {...}}``, so the dicts of all ranks merge with ``dict.update``
into one (what ``torch.distributed.checkpoint`` and frameworks that save from rank 0 need) and each rank's
``load_state_dict`` takes its own part. Keys are strings; values ints, lists and the datasets' own states.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gigashuffle.config import DataloaderConfig
from gigashuffle.errors import CheckpointError
from gigashuffle.procs.messages import LoadState
from gigashuffle.trainer import cut
from gigashuffle.trainer.supervisor import Supervisor
from gigashuffle.trainer.unconsumed import with_unconsumed

# How long state_dict() waits for every writer's answer, a dead writer's respawn included.
REPLY_TIMEOUT_S = 60.0


def rank_key(global_rank: int) -> str:
    return f"rank{global_rank}"


def collect(
    sup: Supervisor,
    config: DataloaderConfig,
    timeout_s: float = REPLY_TIMEOUT_S,
    extra: tuple[str, list[np.ndarray[Any, Any]]] | None = None,
) -> dict[str, Any]:
    """This rank's checkpoint: every writer's dataset state and the rows read and not delivered (NOTE
    [ Checkpoint cut ] in trainer/cut.py).

    A writer that dies before it answers (killed, OOM) is asked again once the supervisor has started it again:
    the new one answers from the state the trainer gave it (NOTE [ Respawned writers ]). Past ``timeout_s`` (or
    once the writer is out of restarts, ``WorkerDied``) this raises instead of hanging.
    """
    answers, rows = cut.take(sup, config, timeout_s)
    if extra is not None:  # the rows of batches handed out and not trained on (trainer/unconsumed.py)
        rows = with_unconsumed(rows, extra)
    return {
        rank_key(config.global_rank): {
            "global_rank": config.global_rank,
            "global_world_size": config.global_world_size,
            "num_writers": config.num_writers,
            "writers": [a.state for a in answers],
            "skip": [a.skip for a in answers],
            "rows": rows,
        }
    }


def own_part(config: DataloaderConfig, state: dict[str, Any]) -> dict[str, Any]:
    """This rank's part of a (merged) checkpoint, checked against this loader's rank layout."""
    if not isinstance(state, dict):
        raise CheckpointError(f"load_state_dict: expected the dict state_dict() returned, got {type(state).__name__}")
    key = rank_key(config.global_rank)
    if key not in state:
        ranks = sorted(k for k in state if isinstance(k, str) and k.startswith("rank"))
        raise CheckpointError(
            f"load_state_dict: the checkpoint has no entry {key!r} for this loader (global rank "
            f"{config.global_rank} of {config.global_world_size}); it has {ranks or list(state)[:8]}. Save the "
            "state of every rank (merge their state_dict()s, or use gathered_state_dict()) and resume with the "
            "same world size"
        )
    mine = state[key]
    expected = {"global_world_size": config.global_world_size, "num_writers": config.num_writers,
                "global_rank": config.global_rank}  # fmt: skip
    for name, value in expected.items():
        if not isinstance(mine, dict) or mine.get(name) != value:
            got = mine.get(name) if isinstance(mine, dict) else mine
            raise CheckpointError(
                f"load_state_dict: the checkpoint has {name}={got!r} but this loader has {value!r}; resume with "
                "the same world size and num_writers (a dataset's state cannot be re-split over another layout)"
            )
    writers = mine.get("writers")
    skip = mine.get("skip", [0] * config.num_writers)
    if not isinstance(writers, list) or len(writers) != config.num_writers:
        raise CheckpointError(f"load_state_dict: {key}['writers'] must list {config.num_writers} dataset states")
    if (
        not isinstance(skip, list)
        or len(skip) != config.num_writers
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in skip)
    ):
        raise CheckpointError(f"load_state_dict: {key}['skip'] must list {config.num_writers} ints >= 0, got {skip!r}")
    rows = mine.get("rows") or {}
    if rows:
        fields = rows.get("fields") if isinstance(rows, dict) else None
        if (
            not isinstance(rows.get("layout"), str)
            or not isinstance(fields, list)
            or not all(isinstance(f, torch.Tensor) and f.dtype == torch.uint8 and f.dim() == 2 for f in fields)
            or len({int(f.shape[0]) for f in fields}) > 1
        ):
            raise CheckpointError(
                f"load_state_dict: {key}['rows'] must be {{'layout': str, 'fields': [uint8 tensor [n, row_bytes] per "
                "field, all with the same n]}} as state_dict() saved it; the checkpoint is damaged"
            )
    return {"writers": writers, "skip": skip, "rows": rows}


def restore(sup: Supervisor, config: DataloaderConfig, state: dict[str, Any]) -> None:
    """Check ``state`` against this rank's layout, then send each writer its own state; a writer started later
    (a respawn) gets it in its spec."""
    mine = own_part(config, state)
    rows = mine["rows"]
    restored: tuple[str, tuple[Any, ...]] = (rows["layout"], tuple(rows["fields"])) if rows else ("", ())
    serials = sup.load_states(mine["writers"], mine["skip"], restored)
    for child in sup.writers():
        i = child.index
        saved = restored if i == 0 else ("", ())
        try:
            child.channel.send(LoadState(mine["writers"][i], mine["skip"][i], serials[i], *saved))
        except OSError:
            continue  # it is dying: its successor starts from the state in its spec
