"""A gigashuffle dataset over a list of shard files whose checkpoint resumes on any number of writers and ranks.

:class:`Sharded` reads shards (local files) through a reader: ``reader(path) -> (rows, read)`` where ``read(start,
stop)`` returns rows ``[start, stop)`` of the shard as a chunk, ``list[dict[str, Tensor]]``. Ready-made readers:
``ParquetReader`` (pyarrow, row group by row group: sources/parquetshards.py), :class:`NpyReader` (a ``.npy`` array,
memory-mapped) and :class:`PtReader` (a ``.pt`` dict of tensors); ``TarReader`` reads webdataset tar shards
(NOTE [ Tar shards ] in sources/tarshards.py). Writer ``g`` of the job's ``G`` (``get_worker_info()``: every writer
of every rank, NOTE [ Splitting a source ]) reads its ``1 / G`` of the rows: the shards are cut into row ranges
(pieces) dealt out by rows, so that shards of different lengths are read at one rate per row (NOTE [ Balanced
pieces ] in sources/shardcursor.py; ``balance=False``: whole shards, ``s % G == g``), in chunks of ``rows`` rows
within one shard. The source is finite: each ``iter()`` is one pass, every row once, and the next ``iter()`` is the
next pass. Its state is a cursor per piece (NOTE [ Shard cursor ]) with the pass number in it;
:meth:`Sharded.reshard_states` re-splits the states of a checkpoint over another number of writers, which is how
``load_state_dict()`` resumes a checkpoint on another world size or ``num_writers`` (NOTE [ Elastic resume ] in
checkpoint/elastic.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle.errors import CheckpointError
from gigashuffle.sources import shardcursor

Chunk = list[dict[str, torch.Tensor]]
ReadRows = Callable[[int, int], Chunk]
ShardReader = Callable[[str], tuple[int, ReadRows]]


class Sharded(IterableDataset):  # type: ignore[type-arg]
    """Shards read in chunks of ``rows`` rows, each row once per pass; elastic checkpoints (see module docstring).

    ``shuffle_shards`` draws each pass's piece order from ``seed`` and the pass number; ``pass_field``, if set, adds
    an int64 field of that name holding each row's pass number. ``balance`` (default) deals the rows out evenly
    over the writers, which opens every shard once per process to learn its length (NOTE [ Balanced pieces ]);
    ``balance=False`` deals whole shards (``s % G``), opening only a writer's own, and reads small shards more often
    per row than large ones when their lengths differ.
    """

    def __init__(
        self,
        shards: Sequence[str | os.PathLike[str]],
        reader: ShardReader,
        rows: int,
        seed: int = 0,
        shuffle_shards: bool = True,
        pass_field: str | None = None,
        balance: bool = True,
    ) -> None:
        if isinstance(shards, (str, os.PathLike)) or not shards:
            raise ValueError(f"Sharded: shards={shards!r} is invalid: pass a non-empty list of shard paths")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"Sharded: rows={rows!r} is invalid: use a positive int (rows per chunk)")
        if not callable(reader):
            raise TypeError(f"Sharded: reader={reader!r} must be callable: path -> (rows, read(start, stop))")
        self.shards = [os.fspath(s) for s in shards]
        self.reader = reader
        self.rows = rows
        self.seed = seed
        self.shuffle_shards = shuffle_shards
        self.pass_field = pass_field
        self.balance = balance
        self._cursor: shardcursor.Cursor | None = None  # None: not placed yet (pass 0 of this writer's share)
        self._owner = (0, 1)
        self._lengths: dict[int, int] = {}
        self._pieces: list[shardcursor.Piece] | None = None  # NOTE [ Balanced pieces ]; found when first needed
        self._reading: tuple[int, ReadRows] | None = None  # the shard open for reading and its read

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_reading": None}  # an open shard stays in the process that opened it

    # -- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This writer's cursor: per shard it owns, the pass and the rows read (past the last chunk yielded)."""
        cursor = self._placed()
        return shardcursor.to_state(cursor, self._shard_lengths(), len(self.shards), *self._owner)

    def load_state_dict(self, state: Any) -> None:
        """Read on from ``state``; the next ``iter()`` goes on with the pass it names."""
        n = len(self.shards)
        cursor, writer, writers = shardcursor.from_state(state, self._shard_lengths(), self._layout(), n)
        info = get_worker_info()
        if info is not None and (info.id, info.num_workers) != (writer, writers):
            raise CheckpointError(
                f"Sharded.load_state_dict: the state is writer {writer}'s of {writers} but this is writer {info.id} "
                f"of {info.num_workers}; re-split the states with reshard_states() (the loader's load_state_dict "
                "does so when the checkpoint's world size or num_writers differs)"
            )
        self._cursor, self._owner = cursor, (writer, writers)

    def reshard_states(self, states: list[Any], skips: list[int], num_writers_total: int) -> list[dict[str, Any]]:
        """The states of every writer of a checkpoint (global writer order, every rank), each after its ``skip``
        rows already written, as one state per writer of a job of ``num_writers_total`` writers."""
        n, layout = len(self.shards), self._layout()
        cursors = []
        for g, (state, skip) in enumerate(zip(states, skips, strict=True)):
            cursor, writer, writers = shardcursor.from_state(state, self._shard_lengths(), layout, n)
            if (writer, writers) != (g, len(states)):
                raise CheckpointError(
                    f"Sharded.reshard_states: state {g} is writer {writer}'s of {writers}; pass the states of all "
                    f"{len(states)} writers in global writer order"
                )
            cursors.append(shardcursor.advance(cursor, skip, self._order_for(cursor), self._piece_length))
        merged = shardcursor.merge(cursors, len(layout))
        parts = shardcursor.split(merged, shardcursor.owners(layout, num_writers_total), num_writers_total)
        lengths = self._shard_lengths()
        return [shardcursor.to_state(c, lengths, n, g, num_writers_total) for g, c in enumerate(parts)]

    # -- reading -------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Chunk]:
        cursor = self._placed()  # a later load_state_dict replaces the dict: this pass then writes to the old one
        while (pass_ := shardcursor.current_pass(cursor)) is not None:
            yielded = False
            for chunk in self._pass(cursor, pass_):
                yielded = True
                yield chunk
            # A pass that had only empty pieces left is the tail of the one before: read the next one now.
            if yielded or all(self._piece_length(p) == 0 for p in cursor):
                return

    def _pass(self, cursor: shardcursor.Cursor, pass_: int) -> Iterator[Chunk]:
        """This writer's pieces still in ``pass_``, in the pass's order. A run of pieces that continue each other
        (the next rows of one shard, not started) is read as one range: chunks of ``rows`` rows span pieces, and
        the cursor of each piece a chunk ends in or passes moves with it."""
        layout = self._layout()
        order = [p for p in self._order_for(cursor)(pass_) if cursor[p][0] == pass_]
        i = 0
        while i < len(order):
            run = [order[i]]
            shard = layout[run[0]][0]
            while (
                i + len(run) < len(order)
                and layout[nxt := order[i + len(run)]][0] == shard
                and layout[nxt][1] == self._piece_end(run[-1])
                and cursor[nxt] == (pass_, 0)
            ):
                run.append(nxt)
            i += len(run)
            done, end = layout[run[0]][1] + cursor[run[0]][1], self._piece_end(run[-1])
            k = self._settle(cursor, run, 0, done, pass_)  # an empty piece, or one read to its end, is finished
            read = self._reader_of(shard) if done < end else None
            while read is not None and done < end:
                stop = min(done + self.rows, end)
                chunk = read(done, stop)
                done = stop
                k = self._settle(cursor, run, k, done, pass_)  # the state is past a chunk once it is yielded
                yield self._tagged(chunk, pass_)

    def _settle(self, cursor: shardcursor.Cursor, run: list[int], k: int, done: int, pass_: int) -> int:
        """Move the cursors of ``run``'s pieces from piece ``k`` on to row ``done`` of their shard: a piece that ends
        by it is finished (at the next pass already), the one it falls in has read up to it. Returns the first
        piece not finished."""
        layout = self._layout()
        while k < len(run) and self._piece_end(run[k]) <= done:
            cursor[run[k]] = (pass_ + 1, 0)
            k += 1
        if k < len(run) and done > layout[run[k]][1]:
            cursor[run[k]] = (pass_, done - layout[run[k]][1])
        return k

    def _tagged(self, chunk: Chunk, pass_: int) -> Chunk:
        if self.pass_field is None:
            return chunk
        group = chunk[0]
        n = len(next(iter(group.values())))
        return [{**group, self.pass_field: torch.full((n,), pass_, dtype=torch.int64)}, *chunk[1:]]

    def _placed(self) -> shardcursor.Cursor:
        if self._cursor is None:
            info = get_worker_info()
            self._owner = (info.id, info.num_workers) if info is not None else (0, 1)
            writer, writers = self._owner
            self._cursor = shardcursor.fresh(shardcursor.owners(self._layout(), writers), writer)
        return self._cursor

    def _layout(self) -> list[shardcursor.Piece]:
        """The pieces (NOTE [ Balanced pieces ]): row ranges of the shards, or whole shards with balance=False."""
        if self._pieces is None:
            n = len(self.shards)
            if self.balance:
                self._pieces = shardcursor.pieces([self._length(s) for s in range(n)])
            else:
                self._pieces = [(s, 0, -1) for s in range(n)]
        return self._pieces

    def _shard_lengths(self) -> list[int] | None:
        """The shards' lengths the pieces were cut from (None: balance=False, whole shards), for the state."""
        return [self._length(s) for s in range(len(self.shards))] if self.balance else None

    def _piece_end(self, piece: int) -> int:
        shard, _first, end = self._layout()[piece]
        return self._length(shard) if end < 0 else end

    def _piece_length(self, piece: int) -> int:
        return self._piece_end(piece) - self._layout()[piece][1]

    def _order_for(self, cursor: shardcursor.Cursor) -> Callable[[int], list[int]]:
        def order(pass_: int) -> list[int]:
            shards = shardcursor.pass_order(self.seed, len(self.shards), pass_, self.shuffle_shards)
            return [p for p in shardcursor.by_shard(self._layout(), shards) if p in cursor]

        return order

    def _reader_of(self, shard: int) -> ReadRows:
        """The shard's ``read``, opened again only when the last piece read was of another shard."""
        if self._reading is None or self._reading[0] != shard:
            self._reading = (shard, self._open(shard)[1])
        return self._reading[1]

    def _open(self, shard: int) -> tuple[int, ReadRows]:
        length, read = self.reader(self.shards[shard])
        self._lengths[shard] = int(length)
        return int(length), read

    def _length(self, shard: int) -> int:
        if shard not in self._lengths:
            rows = getattr(self.reader, "rows", None)  # a reader's cheaper way to the length, if it has one
            if callable(rows):
                self._lengths[shard] = int(rows(self.shards[shard]))
            else:
                self._open(shard)
        return self._lengths[shard]


class NpyReader:
    """Reads ``.npy`` shards, memory-mapped: each row of the array is a row of field ``field``."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __call__(self, path: str) -> tuple[int, ReadRows]:
        array = np.load(path, mmap_mode="r")
        return len(array), lambda start, stop: [{self.field: torch.from_numpy(np.array(array[start:stop]))}]


class PtReader:
    """Reads ``.pt`` shards: a dict of tensors (``torch.save``) sharing their first dimension."""

    def __call__(self, path: str) -> tuple[int, ReadRows]:
        fields = torch.load(path, weights_only=True)
        lengths = {len(t) for t in fields.values()} if isinstance(fields, dict) else set()
        if len(lengths) != 1:
            raise ValueError(f"PtReader: {path} must hold a dict of tensors that share their first dimension")
        return lengths.pop(), lambda start, stop: [{k: t[start:stop] for k, t in fields.items()}]
