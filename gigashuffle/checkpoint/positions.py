"""Checkpoints by positions (``checkpoint_rows="positions"``): the cut records where the unconsumed rows came from,
and the resumed writers re-read them, instead of saving the rows themselves.

NOTE [ Positions checkpoint ]
Every row in the node's buffer carries its *origin* in the slot table (``origin`` column): its writer's lane in
the node (``local_rank * num_writers + index``) and its *stream row*, the number of the row in that writer's
stream, kept across respawns and resumes (procs/positions.py). The writer stamps it while it holds the slot as
``writing``, outside the node lock, like the ``writer`` pid column; a reader copies the origins of a batch's rows
into its ring slot beside the rows. Each writer keeps its dataset's state before each of its recent chunks (the
``state_dict()`` it takes anyway before a fetch, NOTE [ Respawned writers ]): those of the chunks begun within
``KEEP_BUFFERS * shuffle_size`` of its own rows, the oldest dropped first.
The cut is NOTE [ Checkpoint cut ] (checkpoint/cut.py), the same steps and barriers, with fewer rows listed in step
4 (``Coverage``; the saved-rows way is its case of nothing covered). Each writer answers, besides its state,
``head`` (the stream row past every row it committed) and its kept states; once the node is paused each rank
  * reads the origins of the buffer's full slots and of its own announced-not-delivered batches;
  * for each of its writers collects the stream rows of that writer's lane that are at or after its oldest kept
    state: the *unconsumed* rows. Any other row of its lanes in those places, older than every kept state, is
    saved as a row, as in the saved-rows way (so a row that sat in the buffer longer than the states reach is
    still brought back exactly once); local rank 0 also saves the full rows of no lane of the node (origin -1:
    a checkpoint's saved rows put back, or rows of another layout). A row of rank r's writer in rank s's ring is
    saved as a row by s (no exchange between ranks: r's writer does not write it again);
  * per writer keeps the newest kept state at or before its oldest unconsumed row (``at``), or its current state
    when none; the checkpoint holds that state plus ``keep`` (the unconsumed stream rows, as offsets from ``at``)
    and ``until`` (``head - at``): a resumed writer loads the state, writes of the rows before ``until`` only
    those in ``keep`` and every row from ``until`` on. Rows between ``at`` and ``head`` not in ``keep`` were
    delivered to a trainer (consumed) or are saved as rows by another rank.
Batches passed as ``state_dict(unconsumed=[...])`` that are still the ring's zero-copy views are found in their
ring slot by address (``traced``) and counted by their origins like undelivered ones; copies (a device, or a
caller holding most of the ring) are saved as rows, as in the saved-rows way (checkpoint/unconsumed.py). A
checkpoint taken while a writer still re-reads (its filter reaches past its head) carries the rest of that filter
on. A respawned writer keeps its filter and continues its stream's numbering (checkpoint/respawn.py), and with
a filter its commit counter counts stream rows, so it writes exactly the rows its predecessor had not committed.
Elastic resume: a re-split carries states and plain skips only, so ``load_state_dict`` first reads the rows of
each writer's ``keep`` from its state in the training process and saves them as rows (NOTE [ Positions across
layouts ] in checkpoint/rereads.py).
Figures (docs/benchmarks.md, "Positions or saved rows" and "The origin column beside the version"): on tiny 16 B
rows at ``shuffle_size`` 1M, half the state of saved rows but a longer pause and ``state_dict()``; origin
tracking costs about 5% of a tiny row's CPU measured part by part (the end-to-end A B runs here are too noisy to
resolve it); on 8,200-byte token rows positions halves the pause, cuts ``state_dict()`` by 8x and the checkpoint
from 136 MB to 0.1 MB. So ``"saved"`` stays the default (any stateful dataset); positions suits large rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gigashuffle.config import DataloaderConfig
from gigashuffle.errors import CheckpointError
from gigashuffle.procs.messages import DatasetState
from gigashuffle.procs.positions import LANE_SHIFT, ROW_MASK, lane_of
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.resumepoint import ResumePoint
from gigashuffle.rowblock import NO_ROWS, RowBlock
from gigashuffle.shm.slottable import SlotTable
from gigashuffle.trainer.supervisor import Supervisor

_NONE = np.empty(0, dtype=np.int64)


def _covered(
    origins: np.ndarray[Any, Any],
    oldest: dict[int, int],
    found: dict[int, list[Any]],
    saves: np.ndarray[Any, Any] | None = None,
) -> Any:
    """Which ``origins`` a writer of this rank will write again (its lane, at or after its oldest kept state);
    their stream rows go to ``found[lane]``. With ``saves`` (per lane + 1, the last entry for lanes past it: does
    this rank save that lane's rows that are not covered), returns the rows to save instead. One pass over the
    origins whatever the number of lanes: each origin's lane picks its threshold (-1 and foreign lanes: never)."""
    n = len(origins)
    top = max(max(oldest, default=-1), len(saves) - 2 if saves is not None else -1) + 1
    first = np.full(top + 2, np.iinfo(np.int64).max, dtype=np.int64)  # index lane + 1; the last: every other lane
    for lane, row in oldest.items():
        first[lane + 1] = row
    index = (origins >> LANE_SHIFT) + 1  # -1 (no origin) -> 0
    np.minimum(index, top + 1, out=index)
    rows = origins & ROW_MASK
    covered = rows >= first.take(index) if oldest else np.zeros(n, dtype=bool)
    if oldest:
        hit_rows, hit_index = rows[covered], index[covered]
        for lane in oldest:
            found[lane].append(hit_rows if len(oldest) == 1 else hit_rows[hit_index == lane + 1])
    if saves is None:
        return covered
    wanted = np.zeros(top + 2, dtype=bool)
    wanted[: len(saves) - 1] = saves[:-1]
    wanted[len(saves) - 1 :] = saves[-1]
    return ~covered & wanted.take(index)


def traced(batches: Sequence[Any], sup: Supervisor) -> tuple[list[tuple[ChildProcess, int]], list[Any]]:
    """The ``unconsumed`` batches that are views of a ring slot, as (reader, ring slot), and the others."""
    rings = [(c, c.ring, c.ring.memory.numpy_view(0, c.ring.nbytes).ctypes.data) for c in sup.readers() if c.ring]
    found: list[tuple[ChildProcess, int]] = []
    rest: list[Any] = []
    for batch in batches:
        # Only a batch as iter() yields it: anything else goes to unconsumed_rows, which explains what is wrong.
        groups = [batch] if sup.config.batch_format == "dict" and isinstance(batch, dict) else batch
        groups = groups if isinstance(groups, list) else []
        first = next(
            (v for g in groups if isinstance(g, dict) for v in g.values() if isinstance(v, torch.Tensor)), None
        )
        hit = None
        if first is not None and first.device.type == "cpu":
            address = first.data_ptr()
            for child, ring, base in rings:
                if ring is not None and base <= address < base + ring.nbytes:
                    k, offset = divmod(address - base, ring.slot_bytes)
                    hit = (child, k) if offset in ring.field_offsets else None
        if hit is None:
            rest.append(batch)
        else:
            found.append(hit)
    return found, rest


class Coverage:
    """Which of the rows a rank lists at a cut a writer of the node writes again on a resume, so the cut does not
    save them (NOTE [ Positions checkpoint ]): by positions, those of its writers' lanes at or after their oldest
    kept state. The saved-rows way is the case of nothing covered (``by_positions=False``): every listed row is
    saved, and only ``copy_buffer`` (local rank 0) lists the buffer."""

    def __init__(
        self, config: DataloaderConfig, answers: list[DatasetState], by_positions: bool, copy_buffer: bool
    ) -> None:
        self.by_positions = by_positions
        self.copy_buffer = copy_buffer
        self._by_lane = {lane_of(config.local_rank, config.num_writers, a.index): a for a in answers}
        kept = {lane: a.positions["retained"] for lane, a in self._by_lane.items() if by_positions and a.positions}
        self._oldest = {lane: states[0][0] for lane, states in kept.items() if states}
        self._found: dict[int, list[Any]] = {lane: [] for lane in self._oldest}
        # Whose buffer rows this rank saves when no writer of its re-reads them: its own lanes', and on local rank 0
        # those of no writer of the node (no origin, index 0; lanes past the node's, the last entry).
        saves = np.zeros(config.local_world_size * config.num_writers + 2, dtype=bool)
        first_lane = config.local_rank * config.num_writers
        saves[first_lane + 1 : first_lane + 1 + config.num_writers] = True
        saves[0] = saves[-1] = copy_buffer
        self._saves = saves

    @property
    def lists_buffer(self) -> bool:
        """Whether this rank lists the buffer's full slots (every rank by positions: its own lanes')."""
        return self.copy_buffer or self.by_positions

    def ring_rows(self, origins: np.ndarray[Any, Any]) -> Any:
        """Which rows of a ring batch to save (None: all); the rest are noted as found."""
        return ~_covered(origins.copy(), self._oldest, self._found) if self.by_positions else None

    def buffer_ids(self, table: SlotTable) -> Any:
        """The buffer's full slots whose rows this rank saves."""
        full = table.full_ids()
        if not self.by_positions:
            return full
        return full[_covered(table.origin[full], self._oldest, self._found, self._saves)]

    def rebased(self, answers: list[DatasetState]) -> list[DatasetState]:
        """The writers' answers with their unconsumed stream rows as found (``entry_of`` makes entries of them)."""
        return [_found(a, lane, self._found) for lane, a in self._by_lane.items()] if self.by_positions else answers


def _found(answer: DatasetState, lane: int, found: dict[int, list[Any]]) -> DatasetState:
    """The answer with its writer's unconsumed stream rows as found in the pause, unsorted (``entry_of`` sorts them
    after the node goes on: a sort of 600k rows took 26 ms)."""
    info = answer.positions
    if not info or not info["retained"]:
        return answer
    return dataclasses.replace(answer, positions={**info, "found": found.get(lane) or []})


def entry_of(answer: DatasetState) -> tuple[Any, dict[str, Any] | None]:
    """(state, positions entry) of a writer's answer for the checkpoint: ``{"at", "keep", "until"}`` (NOTE
    [ Positions checkpoint ]), or None in the saved-rows way without a filter (the answer's skip stands). ``at`` is
    the newest kept state at or before the writer's oldest unconsumed row, or the state answered if none."""
    info = answer.positions
    if info is None:
        return answer.state, None
    at, state = int(info["at"]), answer.state
    # Each stream row is in one place at most (a slot or a ring slot), so a sort is enough: np.unique (hashing)
    # took 190 ms for 300k rows. Rows found may lie past ``head``: a respawned writer that has not written yet
    # answers its start as its head, and its predecessor's committed rows after it are skipped by its filter.
    rows = np.sort(np.concatenate(info.get("found") or [_NONE]))
    if len(rows):
        starts = np.fromiter((row for row, _ in info["retained"]), dtype=np.int64)
        at, state = info["retained"][int(np.searchsorted(starts, rows[0], side="right")) - 1]
    # The rest of the filter (from the head on) holds rows not written yet, the rows found rows written: disjoint.
    keep = np.sort(np.concatenate([rows, info["keep"]]).astype(np.int64)) - at
    until = max(int(info["head"]), int(info["until"])) - at
    return state, {"at": at, "keep": torch.from_numpy(keep[keep < until]), "until": until}


def checked(key: str, entries: Any, num_writers: int) -> list[dict[str, Any] | None]:
    """A part's ``positions`` list as saved, checked (None: a checkpoint of the saved-rows way)."""
    if entries is None:
        return [None] * num_writers
    bad = CheckpointError(
        f"load_state_dict: {key}['positions'] must list {num_writers} entries, each None or {{'at': int >= 0, "
        "'keep': sorted int64 tensor of offsets in [0, until), 'until': int >= 0}} as state_dict() saved it; the "
        "checkpoint is damaged"
    )
    if not isinstance(entries, list) or len(entries) != num_writers:
        raise bad
    for entry in entries:
        if entry is None:
            continue
        if not isinstance(entry, dict) or not all(
            isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool) and entry[k] >= 0
            for k in ("at", "until")
        ):
            raise bad
        keep = entry.get("keep")
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.int64 or keep.dim() != 1:
            raise bad
        if len(keep) and (int(keep[0]) < 0 or int(keep[-1]) >= entry["until"] or bool((keep[1:] <= keep[:-1]).any())):
            raise bad
    return entries


def point_of(state: Any, skip: int, entry: dict[str, Any] | None, rows: RowBlock = NO_ROWS) -> ResumePoint:
    """A writer's resume point from its part of a checkpoint: its state and skip, and with a positions ``entry``
    its filter as absolute stream rows."""
    if entry is None:
        return ResumePoint(state=state, skip=skip, rows=rows)
    at = int(entry["at"])
    keep = entry["keep"].numpy().astype(np.int64) + at
    return ResumePoint(state=state, skip=skip, base=at, keep=keep, until=at + int(entry["until"]), rows=rows)
