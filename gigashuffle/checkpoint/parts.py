"""The datasets' states in a rank's writers: collected for ``state_dict()``, handed back by ``load_state_dict()``.

Each writer holds its own copy of the dataset, so a checkpoint of a rank is the list of its writers' states in
writer order, plus for each how many rows after that state were already written (``skip``: a writer that was
respawned, or that has not yet re-read what it must not repeat: NOTE [ Respawned writers ] in procs/resume.py), the
queue's name, and the rows read and not delivered with their count and CRC-32 (a truncated or tampered part is
refused). A loader of another rank layout (world size, ``num_writers``) re-splits the states of every rank if the
dataset offers ``reshard_states`` (NOTE [ Elastic resume ] in checkpoint/elastic.py). Every check runs in the training
process before any writer is sent a state: a refused checkpoint loads nothing.

The state is keyed by rank, ``{"rank<global_rank>": {...}}``, so the dicts of all ranks merge with ``dict.update``
into one (what ``torch.distributed.checkpoint`` and frameworks that save from rank 0 need) and each rank's
``load_state_dict`` takes its own part. Keys are strings; values ints, lists and the datasets' own states.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from gigashuffle.checkpoint import cut, elastic, positions
from gigashuffle.checkpoint.cutstate import CutState
from gigashuffle.checkpoint.respawn import ResumePoints
from gigashuffle.config import DataloaderConfig
from gigashuffle.errors import CheckpointError
from gigashuffle.procs.messages import LoadState
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.rowblock import NO_ROWS, RowBlock
from gigashuffle.schema import Layout
from gigashuffle.sources import reshard_of
from gigashuffle.trainer.supervisor import Supervisor

# The checkpoint format each rank's part is written in (docs/checkpoint-format.md); a part without "format" is format
# 0 (before the field existed: the same fields), which still loads. A newer one is refused, never guessed at.
FORMAT = 1
# How long state_dict() waits for every writer's answer, a dead writer's respawn included.
REPLY_TIMEOUT_S = 60.0
# How long load_state_dict() waits for the buffer's layout (the writers' first chunk) to check the saved rows' layout.
LAYOUT_TIMEOUT_S = 300.0


def rank_key(global_rank: int) -> str:
    return f"rank{global_rank}"


def collect(
    sup: Supervisor,
    cuts: CutState,
    config: DataloaderConfig,
    number: int,
    timeout_s: float = REPLY_TIMEOUT_S,
    extra: RowBlock = NO_ROWS,
    handed: Sequence[tuple[ChildProcess, int]] = (),
) -> dict[str, Any]:
    """This rank's checkpoint: every writer's dataset state and the rows read and not delivered (NOTE
    [ Checkpoint cut ] in checkpoint/cut.py).

    A writer that dies before it answers (killed, OOM) is asked again once the supervisor has started it again:
    the new one answers from the state the trainer gave it (NOTE [ Respawned writers ]). Past ``timeout_s`` (or
    once the writer is out of restarts, ``WorkerDied``) this raises instead of hanging.
    """
    answers, cut_rows = cut.take(sup, cuts, config, number, timeout_s, handed)
    # After the cut's rows: those of batches handed out and not trained on (checkpoint/unconsumed.py).
    rows = RowBlock.joined([cut_rows, extra])
    entries = [positions.entry_of(a) for a in answers]  # NOTE [ Positions checkpoint ] in checkpoint/positions.py
    where = {"positions": [e for _s, e in entries]} if any(e is not None for _s, e in entries) else {}
    return {
        rank_key(config.global_rank): {
            "format": FORMAT,
            "queue": config.queue_name,
            "global_rank": config.global_rank,
            "global_world_size": config.global_world_size,
            "num_writers": config.num_writers,
            "writers": [s for s, _e in entries],
            "skip": [0 if e is not None else a.skip for a, (_s, e) in zip(answers, entries, strict=True)],
            **where,
            "rows": rows.to_part(),
        }
    }


def own_part(config: DataloaderConfig, state: dict[str, Any], dataset: Any = None) -> dict[str, Any]:
    """This rank's part of a (merged) checkpoint, checked; re-split from every rank's part when the checkpoint is
    of another world size or ``num_writers`` (NOTE [ Elastic resume ])."""
    if not isinstance(state, dict):
        raise CheckpointError(f"load_state_dict: expected the dict state_dict() returned, got {type(state).__name__}")
    key = rank_key(config.global_rank)
    old = elastic.old_layout(state)
    if old is not None and old != (config.global_world_size, config.num_writers):
        return elastic.reshard(
            config, dataset, state, old, lambda k, part, n: _checked(config, k, part, n), reshard_of(dataset)
        )
    if key not in state:
        ranks = sorted(k for k in state if isinstance(k, str) and k.startswith("rank"))
        raise CheckpointError(
            f"load_state_dict: the checkpoint has no entry {key!r} for this loader (global rank "
            f"{config.global_rank} of {config.global_world_size}); it has {ranks or list(state)[:8]}. Save the "
            "state of every rank (merge their state_dict()s, or use gathered_state_dict())"
        )
    mine = state[key]
    expected = {"global_world_size": config.global_world_size, "num_writers": config.num_writers,
                "global_rank": config.global_rank}  # fmt: skip
    for name, value in expected.items():
        if not isinstance(mine, dict) or mine.get(name) != value:
            got = mine.get(name) if isinstance(mine, dict) else mine
            raise CheckpointError(
                f"load_state_dict: the checkpoint's {key!r} has {name}={got!r} but this loader has {value!r}; "
                "the parts of the checkpoint disagree on the job's layout: it is damaged"
            )
    return _checked(config, key, mine, config.num_writers)


def _checked(config: DataloaderConfig, key: str, part: Any, num_writers: int) -> dict[str, Any]:
    """One rank's part (``key``) of a job of ``num_writers`` writers per rank: its queue, writers, skips, rows."""
    if not isinstance(part, dict):
        raise CheckpointError(f"load_state_dict: {key} must be the dict state_dict() saved, got {type(part).__name__}")
    version = part.get("format", 0)
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= FORMAT:
        raise CheckpointError(
            f"load_state_dict: {key} is in checkpoint format {version!r} but this gigashuffle reads formats 0 to "
            f"{FORMAT}; load it with the gigashuffle version that saved it (or a newer one)"
        )
    if part.get("queue") != config.queue_name:
        raise CheckpointError(
            f"load_state_dict: {key} is a checkpoint of queue {part.get('queue')!r} but this loader's queue is "
            f"{config.queue_name!r}; load the checkpoint that this queue saved (or name the queue as it was)"
        )
    writers = part.get("writers")
    skip = part.get("skip", [0] * num_writers)
    if not isinstance(writers, list) or len(writers) != num_writers:
        raise CheckpointError(f"load_state_dict: {key}['writers'] must list {num_writers} dataset states")
    if (
        not isinstance(skip, list)
        or len(skip) != num_writers
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in skip)
    ):
        raise CheckpointError(f"load_state_dict: {key}['skip'] must list {num_writers} ints >= 0, got {skip!r}")
    rows = RowBlock.from_part(key, part.get("rows"))
    where = positions.checked(key, part.get("positions"), num_writers)
    return {"writers": writers, "skip": skip, "rows": rows, "positions": where}


def restore(sup: Supervisor, resume: ResumePoints, config: DataloaderConfig, state: dict[str, Any]) -> None:
    """Check ``state`` against this rank's layout (re-split if it is another one) and the saved rows against the
    buffer's row layout, then send each writer its own state; a writer started later (a respawn) gets it in its
    spec. Nothing is sent before every check has passed."""
    mine = own_part(config, state, sup.dataset)
    rows: RowBlock = mine["rows"]
    if len(rows):
        _check_layout(sup, config, rows.layout_json)
    entries = mine.get("positions") or [None] * config.num_writers
    # Each writer puts a contiguous share of the saved rows back before it reads on (NOTE [ Checkpoint cut ]).
    shares = rows.dealt(config.num_writers)
    rank_points = [
        positions.point_of(state, skip, entry, shares[i])
        for i, (state, skip, entry) in enumerate(zip(mine["writers"], mine["skip"], entries, strict=True))
    ]
    points = resume.load(rank_points)
    sup.say_go(send=False)  # a LoadState says go; writers started later start going
    for child in sup.writers():
        sup.send(child, LoadState(points[child.index]))  # a dying one's successor starts from its spec's point


def _check_layout(sup: Supervisor, config: DataloaderConfig, layout_json: str) -> None:
    """The saved rows must fit this queue's buffer: wait for its published layout (the writers' first chunk),
    compare."""
    try:
        saved = Layout.from_json(layout_json)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"load_state_dict: the saved rows' layout {layout_json[:200]!r} is damaged: {exc}"
        ) from exc
    deadline = time.monotonic() + LAYOUT_TIMEOUT_S
    while (buffer := sup.node_table.layout()) is None:  # the published one: nothing is mapped for it
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"load_state_dict: queue {config.queue_name!r} has no buffer after {LAYOUT_TIMEOUT_S:.0f} s (no "
                "writer produced its first chunk), so the saved rows cannot be checked against it; see the log"
            )
        sup.pump()
    if buffer == saved:
        return
    mine = {f.label: f.describe() for f in buffer.fields}
    theirs = {f.label: f.describe() for f in saved.fields}
    differ = [
        f"{label}: checkpoint {theirs.get(label, 'absent')}, dataset {mine.get(label, 'absent')}"
        for label in sorted({*mine, *theirs})
        if mine.get(label) != theirs.get(label)
    ] or [f"field order: checkpoint [{saved.describe()}], dataset [{buffer.describe()}]"]
    raise CheckpointError(
        f"load_state_dict: the checkpoint's saved rows do not fit the rows this dataset yields ({'; '.join(differ)}); "
        "resume with the dataset (fields, dtypes, row shapes) that wrote the checkpoint"
    )
