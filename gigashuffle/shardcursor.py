"""Where a :class:`gigashuffle.shards.Sharded` source is in its shards: a cursor that splits over any number of writers.

NOTE [ Shard cursor ]
The cursor maps each shard a writer owns to ``(pass, rows)``: the pass that shard is in and how many of its rows that
pass has read. A shard whose last row was read moves to ``(pass + 1, 0)`` at once, so ``rows`` is always below the
shard's length and "done with pass p" and "at the start of pass p + 1" are one state. A writer's pass is the lowest
pass among its shards; it reads, in that pass's order (a permutation of all shards drawn from the source's seed and
the pass number, restricted to the writer's own), every shard still in that pass, from its ``rows`` on. Because the
position is per shard and not per writer, cursors of any number of writers merge into one map of every shard and
split again over any other number: shard ``s`` goes to writer ``s % G`` of ``G``. Shards that were ahead by a pass
(their writer had started the next pass) simply wait for the others. A checkpoint's ``skip`` (rows after a state
already written, NOTE [ Respawned writers ]) becomes a cursor advance along the old writer's order
(:func:`advance`), so the re-split cursor needs no skip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gigashuffle.errors import CheckpointError

Cursor = dict[int, tuple[int, int]]  # shard index -> (pass, rows of it read in that pass)
FORMAT = "gigashuffle.Sharded/1"


def fresh(num_shards: int, writer: int, writers: int) -> Cursor:
    """Writer ``writer`` of ``writers`` at the start of pass 0: the shards ``s`` with ``s % writers == writer``."""
    return {s: (0, 0) for s in range(writer, num_shards, writers)}


def current_pass(cursor: Cursor) -> int | None:
    """The pass a writer is in (None: it owns no shard)."""
    return min((p for p, _ in cursor.values()), default=None)


def pass_order(seed: int, num_shards: int, pass_: int, shuffle: bool) -> list[int]:
    """Every shard in the order pass ``pass_`` reads them (each writer reads its own in this order)."""
    if not shuffle:
        return list(range(num_shards))
    return [int(s) for s in np.random.default_rng([seed, pass_]).permutation(num_shards)]


def advance(cursor: Cursor, rows: int, order: Callable[[int], list[int]], length: Callable[[int], int]) -> Cursor:
    """``cursor`` moved on by ``rows`` rows of its writer's stream (its pass order, shard lengths)."""
    out = dict(cursor)
    barren = 0  # passes in a row that held no row: a skip past the end of an empty share is damage
    while rows > 0:
        pass_ = current_pass(out)
        if pass_ is None or barren > 1:
            raise CheckpointError(f"a writer's skip of {rows} rows goes past the end of its shards: damaged state")
        moved = False
        for shard in order(pass_):
            if shard not in out or out[shard][0] != pass_:
                continue
            left = length(shard) - out[shard][1]
            if rows < left:
                out[shard] = (pass_, out[shard][1] + rows)
                return out
            rows -= left
            moved = moved or left > 0
            out[shard] = (pass_ + 1, 0)
        barren = 0 if moved else barren + 1
    return out


def to_state(cursor: Cursor, num_shards: int, writer: int, writers: int) -> dict[str, Any]:
    return {"format": FORMAT, "num_shards": num_shards, "writer": writer, "writers": writers,
            "cursor": [[s, p, r] for s, (p, r) in sorted(cursor.items())]}  # fmt: skip


def from_state(state: Any, num_shards: int) -> tuple[Cursor, int, int]:
    """(cursor, writer, writers) of a state from :func:`to_state`, checked against a source of ``num_shards``."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"Sharded.load_state_dict: expected a state of {FORMAT!r} (what Sharded.state_dict() returns), got "
            f"{_short(state)}"
        )
    if state.get("num_shards") != num_shards:
        raise CheckpointError(
            f"Sharded.load_state_dict: the state is of a source of {state.get('num_shards')!r} shards but this one "
            f"has {num_shards}; resume with the same list of shards"
        )
    cursor: Cursor = {}
    for entry in state.get("cursor", ()):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and all(_count(v) for v in entry)):
            raise CheckpointError(f"Sharded.load_state_dict: cursor entry {entry!r} is not [shard, pass, rows]")
        shard, pass_, rows = (int(v) for v in entry)
        if shard >= num_shards or shard in cursor:
            raise CheckpointError(f"Sharded.load_state_dict: cursor names shard {shard} twice or out of range")
        cursor[shard] = (pass_, rows)
    writer, writers = state.get("writer"), state.get("writers")
    if not (isinstance(writer, int) and isinstance(writers, int) and _count(writer) and 0 <= writer < writers):
        raise CheckpointError(f"Sharded.load_state_dict: writer={writer!r} of writers={writers!r} is invalid")
    return cursor, writer, writers


def merge(cursors: Sequence[Cursor], num_shards: int) -> Cursor:
    """One cursor over every shard from the cursors of all writers of a job (each shard in exactly one)."""
    merged: Cursor = {}
    for cursor in cursors:
        for shard, at in cursor.items():
            if shard in merged:
                raise CheckpointError(f"Sharded.reshard_states: shard {shard} is in two writers' states")
            merged[shard] = at
    missing = sorted(set(range(num_shards)) - set(merged))
    if missing:
        raise CheckpointError(
            f"Sharded.reshard_states: shards {missing[:10]} are in no writer's state; pass the states of every "
            "writer of every rank of the checkpoint"
        )
    return merged


def split(merged: Cursor, writers: int) -> list[Cursor]:
    """``merged`` over ``writers`` writers: writer ``g`` gets the shards ``s % writers == g``."""
    return [{s: at for s, at in merged.items() if s % writers == g} for g in range(writers)]


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 120 else text[:117] + "..."
