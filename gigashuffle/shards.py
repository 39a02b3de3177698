"""A gigashuffle dataset over a list of shard files whose checkpoint resumes on any number of writers and ranks.

:class:`Sharded` reads shards (local files) through a reader: ``reader(path) -> (rows, read)`` where ``read(start,
stop)`` returns rows ``[start, stop)`` of the shard as a chunk, ``list[dict[str, Tensor]]``. Ready-made readers:
:class:`gigashuffle.parquetshards.ParquetReader` (pyarrow, row group by row group), :class:`NpyReader` (a ``.npy``
array, memory-mapped) and :class:`PtReader` (a ``.pt`` dict of tensors); :class:`gigashuffle.tarshards.TarReader`
reads webdataset tar shards (NOTE [ Tar shards ]). Writer ``g`` of the job's ``G`` (``get_worker_info()``: every writer
of every rank, NOTE [ Splitting a source ]) reads the shards ``s % G == g``, in chunks of ``rows`` rows within one
shard. The source is finite: each ``iter()`` is one pass, every row once, and the next ``iter()`` is the next pass.
Its state is a cursor per shard (NOTE [ Shard cursor ] in gigashuffle/shardcursor.py) with the pass number in it;
:meth:`Sharded.reshard_states` re-splits the states of a checkpoint over another number of writers, which is how
``load_state_dict()`` resumes a checkpoint on another world size or ``num_writers`` (NOTE [ Elastic resume ] in
trainer/elastic.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle import shardcursor
from gigashuffle.errors import CheckpointError

Chunk = list[dict[str, torch.Tensor]]
ReadRows = Callable[[int, int], Chunk]
ShardReader = Callable[[str], tuple[int, ReadRows]]


class Sharded(IterableDataset):  # type: ignore[type-arg]
    """Shards read in chunks of ``rows`` rows, each row once per pass; elastic checkpoints (see module docstring).

    ``shuffle_shards`` draws each pass's shard order from ``seed`` and the pass number; ``pass_field``, if set, adds
    an int64 field of that name holding each row's pass number.
    """

    def __init__(
        self,
        shards: Sequence[str | os.PathLike[str]],
        reader: ShardReader,
        rows: int,
        seed: int = 0,
        shuffle_shards: bool = True,
        pass_field: str | None = None,
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
        self._cursor: shardcursor.Cursor | None = None  # None: not placed yet (pass 0 of this writer's share)
        self._owner = (0, 1)
        self._lengths: dict[int, int] = {}

    # -- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This writer's cursor: per shard it owns, the pass and the rows read (past the last chunk yielded)."""
        cursor = self._placed()
        return shardcursor.to_state(cursor, len(self.shards), *self._owner)

    def load_state_dict(self, state: Any) -> None:
        """Read on from ``state``; the next ``iter()`` goes on with the pass it names."""
        cursor, writer, writers = shardcursor.from_state(state, len(self.shards))
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
        n = len(self.shards)
        cursors = []
        for g, (state, skip) in enumerate(zip(states, skips, strict=True)):
            cursor, writer, writers = shardcursor.from_state(state, n)
            if (writer, writers) != (g, len(states)):
                raise CheckpointError(
                    f"Sharded.reshard_states: state {g} is writer {writer}'s of {writers}; pass the states of all "
                    f"{len(states)} writers in global writer order"
                )
            cursors.append(shardcursor.advance(cursor, skip, self._order_for(cursor), self._length))
        merged = shardcursor.merge(cursors, n)
        parts = shardcursor.split(merged, num_writers_total)
        return [shardcursor.to_state(c, n, g, num_writers_total) for g, c in enumerate(parts)]

    # -- reading -------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Chunk]:
        cursor = self._placed()  # a later load_state_dict replaces the dict: this pass then writes to the old one
        while (pass_ := shardcursor.current_pass(cursor)) is not None:
            yielded = False
            for chunk in self._pass(cursor, pass_):
                yielded = True
                yield chunk
            # A pass that had only empty shards left is the tail of the one before: read the next one now.
            if yielded or all(self._lengths.get(s) == 0 for s in cursor):
                return

    def _pass(self, cursor: shardcursor.Cursor, pass_: int) -> Iterator[Chunk]:
        for shard in self._order_for(cursor)(pass_):
            at = cursor.get(shard)
            if at is None or at[0] != pass_:
                continue
            length, read = self._open(shard)
            done = at[1]
            if done >= length:
                cursor[shard] = (pass_ + 1, 0)
                continue
            while done < length:
                stop = min(done + self.rows, length)
                chunk = read(done, stop)
                done = stop
                # The state is past a chunk once it is yielded: a finished shard is at the next pass already.
                cursor[shard] = (pass_ + 1, 0) if done == length else (pass_, done)
                yield self._tagged(chunk, pass_)

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
            self._cursor = shardcursor.fresh(len(self.shards), *self._owner)
        return self._cursor

    def _order_for(self, cursor: shardcursor.Cursor) -> Callable[[int], list[int]]:
        def order(pass_: int) -> list[int]:
            every = shardcursor.pass_order(self.seed, len(self.shards), pass_, self.shuffle_shards)
            return [s for s in every if s in cursor]

        return order

    def _open(self, shard: int) -> tuple[int, ReadRows]:
        length, read = self.reader(self.shards[shard])
        self._lengths[shard] = int(length)
        return int(length), read

    def _length(self, shard: int) -> int:
        if shard not in self._lengths:
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
