"""Resuming a checkpoint on another world size or ``num_writers``: the datasets' states re-split, the saved rows shared.

NOTE [ Elastic resume ]
A checkpoint is rank-keyed (checkpoint/parts.py): each old rank's part holds its writers' dataset states, the
rows already written after each (``skip``) and the rows it had read and not delivered. When ``load_state_dict()``
finds that the checkpoint's layout (``global_world_size``, ``num_writers``) is not the loader's, it needs every old
rank's part (a merged dict: ``gathered_state_dict()`` or every rank's ``state_dict()`` merged) and a dataset that can
re-split its state: ``dataset.reshard_states(states, skips, num_writers_total) -> list`` takes the states of all old
writers in global writer order (rank by rank), with their skips, and returns one state per new global writer
(``global_rank * num_writers + index``), every skip folded in (:class:`gigashuffle.sources.Sharded` does: NOTE
[ Shard cursor ]). Every new rank computes the same re-split and keeps its own writers' states. The saved rows of all
old ranks, in rank order, are cut into ``global_world_size`` contiguous shares; new rank ``r`` puts back share
``r`` (dealt among its writers, as without a re-split), so each saved row comes back once in the job. A checkpoint by
positions turns its writers' filters into saved rows and plain skips first (NOTE [ Positions across layouts ] in
checkpoint/rereads.py). A dataset without
``reshard_states`` gets a ``CheckpointError`` naming both layouts and what it must offer; nothing is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gigashuffle.checkpoint import rereads
from gigashuffle.config import DataloaderConfig
from gigashuffle.errors import CheckpointError
from gigashuffle.rowblock import RowBlock

Part = dict[str, Any]  # a rank's checked part: {"writers": [...], "skip": [...], "rows": RowBlock, "positions"}


def layout_of(part: Any) -> tuple[Any, Any]:
    """(global_world_size, num_writers) of a rank's part as saved."""
    if not isinstance(part, dict):
        return None, None
    return part.get("global_world_size"), part.get("num_writers")


def old_layout(state: dict[str, Any]) -> tuple[int, int] | None:
    """The layout the checkpoint's parts name, if they agree on one with ints; else None."""
    layouts = {layout_of(v) for k, v in state.items() if isinstance(k, str) and k.startswith("rank")}
    if len(layouts) != 1:
        return None
    world, writers = layouts.pop()
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (world, writers))
    return (world, writers) if ok else None


def reshard(
    config: DataloaderConfig,
    dataset: Any,
    state: dict[str, Any],
    old: tuple[int, int],
    check: Callable[[str, Any, int], Part],
    reshard_states: Callable[..., list[Any]] | None,
) -> Part:
    """This rank's part of ``state`` (a checkpoint of layout ``old``) re-split for this loader's layout; ``check``
    validates one old part (its key, the part, its num_writers)."""
    world, writers = old
    differs = (
        f"the checkpoint is of global_world_size={world}, num_writers={writers} and this loader has "
        f"global_world_size={config.global_world_size}, num_writers={config.num_writers}"
    )
    if reshard_states is None:
        raise CheckpointError(
            f"load_state_dict: {differs}, and the dataset {type(dataset).__name__} cannot re-split its state: it "
            "must offer reshard_states(states, skips, num_writers_total) -> one state per new writer (as "
            "gigashuffle.sources.Sharded does), or resume with the checkpoint's world size and num_writers"
        )
    keys = [f"rank{r}" for r in range(world)]
    missing = [k for k in keys if k not in state]
    if missing:
        raise CheckpointError(
            f"load_state_dict: {differs}; re-splitting needs every old rank's part but {missing[:8]} are missing: "
            "save gathered_state_dict() (or merge every rank's state_dict()) and load that dict on every rank"
        )
    parts = [check(k, state[k], writers) for k in keys]
    states = [s for p in parts for s in p["writers"]]
    skips: list[int] = []
    segments: list[RowBlock | rereads.Kept] = []  # every saved row of the job, in rank order
    for rank, (key, part) in enumerate(zip(keys, parts, strict=True)):
        # NOTE [ Positions across layouts ]; each old writer's rows re-read as that writer (its worker id)
        part_skips, kept = rereads.fold(dataset, key, part, rank * writers, world * writers)
        skips += part_skips
        segments += [part["rows"], *kept]
    total = config.global_world_size * config.num_writers
    new = list(reshard_states(states, skips, total))
    if len(new) != total:
        raise CheckpointError(
            f"load_state_dict: {type(dataset).__name__}.reshard_states returned {len(new)} states for {total} writers"
        )
    first = config.global_rank * config.num_writers
    return {
        "writers": new[first : first + config.num_writers],
        "skip": [0] * config.num_writers,
        "rows": RowBlock.joined(rereads.share(segments, config.global_rank, config.global_world_size)),
    }
