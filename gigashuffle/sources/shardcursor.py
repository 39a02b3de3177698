"""Where a ``Sharded`` source is in its shards: a cursor that merges and splits over any number of writers.

NOTE [ Shard cursor ]
The cursor maps each piece a writer owns to ``(pass, rows)``: the pass that piece is in and how many of its rows that
pass has read. A piece is a row range of one shard (NOTE [ Balanced pieces ] below; with ``balance=False`` a whole
shard). A piece whose last row was read moves to ``(pass + 1, 0)`` at once, so ``rows`` is always below the piece's
length and "done with pass p" and "at the start of pass p + 1" are one state. A writer's pass is the lowest pass
among its pieces; it reads, in that pass's shard order (a permutation of all shards drawn from the source's seed and
the pass number), every piece of its own still in that pass, from its ``rows`` on. Because the position is per
piece and not per writer, cursors of any number of writers merge into one map of every piece and split again over
any other number (:func:`owners` says which writer gets which). Pieces that were ahead by a pass (their writer had
started the next pass) simply wait for the others. A checkpoint's ``skip`` (rows after a state already written,
NOTE [ Respawned writers ] in procs/resume.py) becomes a cursor advance along the old writer's order
(:func:`advance`), so the re-split cursor needs no skip.

NOTE [ Balanced pieces ]
Writers read at about one rate each, so a writer's share of the rows sets how often each of its rows is read: shards
dealt out by count (``s % G``) read a writer's small shards more often per row than another's large ones (issue 35:
6 parquet shards over 4 writers, two shards read twice as often per row). So the shards are cut into pieces, row
ranges whose layout depends on the shard lengths only (never on the number of writers, so cursors of one job split
over another's writers): pieces of at most ``1 / PIECES`` of all rows, each shard cut into as few of them as it
takes, of near-equal length. Writer ``g`` of ``G`` owns the pieces whose middle row falls in the ``g``-th ``1 / G``
of all rows (pieces in shard order), so each writer's share is within half a piece (``1 / (2 * PIECES)`` of the
rows) of ``1 / G``: within 10% of it up to ``PIECES / 5`` writers. A writer's pieces are consecutive ranges of few
shards, and a pass reads them shard by shard (in the pass's shard order), each shard opened once per pass. Finding
the layout opens every shard once per process (the reader's ``(rows, read)``, or its ``rows(path)`` if it has one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gigashuffle.errors import CheckpointError

Cursor = dict[int, tuple[int, int]]  # piece index -> (pass, rows of it read in that pass)
Piece = tuple[int, int, int]  # (shard, first row, end row); end -1: the shard's end (balance=False)
FORMAT = "gigashuffle.Sharded/2"
FORMAT_1 = "gigashuffle.Sharded/1"  # one piece per shard, owned by writer s % G: loads where the layout is that
PIECES = 1024


def pieces(lengths: Sequence[int]) -> list[Piece]:
    """The pieces of shards of ``lengths`` rows: NOTE [ Balanced pieces ]."""
    size = max(1, -(-sum(lengths) // PIECES))
    out: list[Piece] = []
    for shard, n in enumerate(lengths):
        k = max(1, -(-n // size))  # an empty shard is an empty piece: piece and shard indices agree more often
        out += [(shard, n * i // k, n * (i + 1) // k) for i in range(k)]
    return out


def owners(layout: Sequence[Piece], writers: int) -> list[int]:
    """The writer of ``writers`` that owns each piece: by rows (NOTE [ Balanced pieces ]), or ``i % writers`` for
    whole-shard pieces (``balance=False``)."""
    total = sum(stop - start for _s, start, stop in layout)
    if total <= 0 or any(stop < 0 for _s, _a, stop in layout):
        return [i % writers for i in range(len(layout))]
    out, before = [], 0
    for _shard, start, stop in layout:
        out.append(min(writers - 1, (2 * before + stop - start) * writers // (2 * total)))
        before += stop - start
    return out


def fresh(owner: Sequence[int], writer: int) -> Cursor:
    """Writer ``writer`` at the start of pass 0: the pieces ``owner`` gives it."""
    return {i: (0, 0) for i, o in enumerate(owner) if o == writer}


def current_pass(cursor: Cursor) -> int | None:
    """The pass a writer is in (None: it owns no shard)."""
    return min((p for p, _ in cursor.values()), default=None)


def pass_order(seed: int, num_shards: int, pass_: int, shuffle: bool) -> list[int]:
    """Every shard in the order pass ``pass_`` reads them (each writer reads its own pieces in this order)."""
    if not shuffle:
        return list(range(num_shards))
    return [int(s) for s in np.random.default_rng([seed, pass_]).permutation(num_shards)]


def by_shard(layout: Sequence[Piece], shards: Sequence[int]) -> list[int]:
    """Every piece, shard by shard in the order ``shards`` (a shard's pieces in row order)."""
    of: dict[int, list[int]] = {}
    for piece, (shard, _a, _e) in enumerate(layout):
        of.setdefault(shard, []).append(piece)
    return [p for s in shards for p in of.get(s, ())]


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


def to_state(
    cursor: Cursor, lengths: Sequence[int] | None, num_shards: int, writer: int, writers: int
) -> dict[str, Any]:
    """The state of a writer's ``cursor``; ``lengths``: the shards' lengths the pieces were cut from (None:
    ``balance=False``, whole shards)."""
    return {"format": FORMAT, "num_shards": num_shards, "lengths": None if lengths is None else list(lengths),
            "writer": writer, "writers": writers,
            "cursor": [[s, p, r] for s, (p, r) in sorted(cursor.items())]}  # fmt: skip


def whole_shards(layout: Sequence[Piece], num_shards: int) -> bool:
    """Whether ``layout`` is one piece per shard, in shard order (what a state of :data:`FORMAT_1` means)."""
    return [(s, a) for s, a, _e in layout] == [(s, 0) for s in range(num_shards)]


def from_state(
    state: Any, lengths: Sequence[int] | None, layout: Sequence[Piece], num_shards: int
) -> tuple[Cursor, int, int]:
    """(cursor, writer, writers) of a state from :func:`to_state`, checked against a source of ``num_shards`` shards
    of ``lengths`` rows cut into ``layout`` (``lengths`` None: ``balance=False``)."""
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt not in (FORMAT, FORMAT_1):
        raise CheckpointError(
            f"Sharded.load_state_dict: expected a state of {FORMAT!r} (what Sharded.state_dict() returns), got "
            f"{_short(state)}"
        )
    if state.get("num_shards") != num_shards:
        raise CheckpointError(
            f"Sharded.load_state_dict: the state is of a source of {state.get('num_shards')!r} shards but this one "
            f"has {num_shards}; resume with the same list of shards"
        )
    if fmt == FORMAT_1 and not whole_shards(layout, num_shards):
        raise CheckpointError(
            f"Sharded.load_state_dict: the state is of {FORMAT_1!r}, whose writers own whole shards, but this source "
            f"cuts its shards into {len(layout)} pieces (NOTE [ Balanced pieces ] in "
            "gigashuffle/sources/shardcursor.py); "
            "resume it with Sharded(..., balance=False)"
        )
    theirs = state.get("lengths")
    if fmt == FORMAT and theirs != (None if lengths is None else list(lengths)):
        if theirs is None or lengths is None:
            raise CheckpointError(
                f"Sharded.load_state_dict: the state was taken with balance={theirs is not None} and this source has "
                f"balance={lengths is not None}; resume with the balance= the checkpoint was taken with"
            )
        differ = [(s, a, b) for s, (a, b) in enumerate(zip(theirs, lengths, strict=False)) if a != b][:3]
        raise CheckpointError(
            "Sharded.load_state_dict: the shards' lengths differ from the state's (shard, state's rows, rows now): "
            f"{differ}; resume with the same shards, unchanged on disk"
        )
    num_pieces = len(layout)
    cursor: Cursor = {}
    for entry in state.get("cursor", ()):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and all(_count(v) for v in entry)):
            raise CheckpointError(f"Sharded.load_state_dict: cursor entry {entry!r} is not [piece, pass, rows]")
        piece, pass_, rows = (int(v) for v in entry)
        if piece >= num_pieces or piece in cursor:
            raise CheckpointError(f"Sharded.load_state_dict: cursor names piece {piece} twice or out of range")
        cursor[piece] = (pass_, rows)
    writer, writers = state.get("writer"), state.get("writers")
    if not (isinstance(writer, int) and isinstance(writers, int) and _count(writer) and 0 <= writer < writers):
        raise CheckpointError(f"Sharded.load_state_dict: writer={writer!r} of writers={writers!r} is invalid")
    return cursor, writer, writers


def merge(cursors: Sequence[Cursor], num_pieces: int) -> Cursor:
    """One cursor over every piece from the cursors of all writers of a job (each piece in exactly one)."""
    merged: Cursor = {}
    for cursor in cursors:
        for shard, at in cursor.items():
            if shard in merged:
                raise CheckpointError(f"Sharded.reshard_states: piece {shard} is in two writers' states")
            merged[shard] = at
    missing = sorted(set(range(num_pieces)) - set(merged))
    if missing:
        raise CheckpointError(
            f"Sharded.reshard_states: pieces {missing[:10]} are in no writer's state; pass the states of every "
            "writer of every rank of the checkpoint"
        )
    return merged


def split(merged: Cursor, owner: Sequence[int], writers: int) -> list[Cursor]:
    """``merged`` over ``writers`` writers: writer ``g`` gets the pieces ``owner`` gives it."""
    return [{s: at for s, at in merged.items() if owner[s] == g} for g in range(writers)]


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 120 else text[:117] + "..."
