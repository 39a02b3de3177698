"""The checkpoint cut explored interleaving by interleaving (tests/model/cutmodel.py; issue 32, item 6).

Every order of the actors' steps of a small node, a SIGKILL of any child at any step and a KeyboardInterrupt at
any step of the cut, then a resume: every row of the pass once. Each mutation puts one bug back and must be found.
The slot-table model the explorer runs on is checked op by op against the real ``SlotTable``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from model import table as tm
from model.cutmodel import Config, Result, explore, report, writers_first

from gigashuffle.shm.slottable import EMPTY, FULL, READING, WRITING, SlotTable

# One writer, one reader, a buffer of two slots, rows in chunks of one: small enough to explore every world.
ONE: dict[str, Any] = dict(writers=1, rows=2, chunk=1, slots=2, depth=1, min_full=2)
# Two writers whose first-mix share (one row) ends inside their first chunk (two rows).
MIX: dict[str, Any] = dict(writers=2, rows=2, chunk=2, slots=3, depth=1, min_full=2, kills=0, interrupts=0)
# Two trainers of one node (the node barrier PAUSED/LISTED/COPIED), one writer and one reader each.
TWO: dict[str, Any] = dict(
    trainers=2, writers=1, readers=1, rows=2, chunk=1, slots=2, depth=2, bs=1, min_full=1, kills=0, interrupts=0
)


def _explored(name: str, result: Result) -> Result:
    print(report(name, result))
    return result


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("a kill of any child at any step", Config(**ONE, kills=1, interrupts=0)),
        ("a Ctrl-C at any step of the cut, then a second checkpoint", Config(**ONE, kills=0, interrupts=1)),
        ("two writers under the first mix", Config(**MIX)),
    ],
)
def test_every_interleaving_delivers_each_row_once(name: str, config: Config) -> None:
    result = _explored(name, explore(config))
    assert result.counterexample is None, report(name, result)
    assert result.complete and result.runs > 0


def test_two_trainers_of_one_node_bounded() -> None:
    """Two ranks' product is too large to explore whole in a unit test: the first 25,000 worlds, from the start
    where both writers filled the buffer (the ranks' cuts in every order from there)."""
    cfg = Config(**TWO)
    result = _explored(
        "two trainers (bounded)", explore(cfg, max_states=25_000, bounded=True, start=writers_first(cfg))
    )
    assert result.counterexample is None, report("two trainers", result)
    assert result.runs > 0


@pytest.mark.parametrize(
    ("name", "config", "start", "trainers_first"),
    [
        ("(a) the first-mix wait answers from the chunk's start (before 171b336)",
         Config(**MIX, answer_from_chunk_start=True), False, False),
        ("(b) a stale Paused of an aborted cut counts for the next (before 82d4221)",
         Config(**ONE, kills=0, interrupts=1, stale_paused=True), False, False),
        ("(c) the cut skips the node barrier COPIED", Config(**TWO, skip_copied=True), True, True),
        ("(d) a respawned writer does not skip what its predecessor committed",
         Config(**ONE, kills=1, interrupts=0, no_respawn_skip=True), False, False),
    ],
)  # fmt: skip
def test_the_explorer_finds_each_mutation(name: str, config: Config, start: bool, trainers_first: bool) -> None:
    first = writers_first(config) if start else None
    result = _explored(name, explore(config, max_states=200_000, trainers_first=trainers_first, start=first))
    assert result.counterexample is not None, f"{name}: not found in {result.states} worlds"
    assert result.counterexample[-1].startswith("FAILED")


def test_the_table_model_follows_the_real_slot_table() -> None:
    """Random ops on the real SlotTable and on the model side by side: the same slots, states, holders and lanes
    after each. The model is given the ids the real table chose (the real draw is random, the model's the lowest
    ids), after checking that they were a choice the model allows."""
    rng = random.Random(32)
    slots, lanes = 6, 4
    for _run in range(20):
        real = SlotTable(slots, seed=rng.randrange(1000))
        model = tm.Table.new(slots, lanes)
        held: dict[int, list[int]] = {}  # pid -> ids it holds (writing or reading), by the real table
        for _op in range(60):
            pid = rng.choice((11, 12, 21, 22))
            writer = pid < 20
            lane = pid % 10
            mine = held.setdefault(pid, [])
            op = rng.random()
            if writer and (not mine or op < 0.4):
                n = rng.randint(1, 3)
                ids = tuple(int(i) for i in real.acquire_empty(pid, n))
                assert len(ids) == min(n, model.count(tm.EMPTY))
                assert all(model.state[i] == tm.EMPTY for i in ids)
                model = _forced(model, ids, tm.WRITING, pid)
                mine.extend(ids)
            elif writer and op < 0.8:
                ids = tuple(mine)
                assert real.commit_written(pid, list(ids), lane) == len(ids)
                model = tm.commit(model, pid, ids, lane)
                mine.clear()
            elif writer:
                ids = tuple(mine)
                real.give_back(pid, list(ids))
                model = tm.give_back(model, pid, ids)
                mine.clear()
            elif not mine:
                n, min_full = rng.randint(1, 2), rng.randint(0, 3)
                got, _versions = real.draw_full(pid, n, min_full)
                ids = tuple(int(i) for i in got)
                _m, model_ids = tm.draw(model, pid, n, min_full)
                assert len(ids) == len(model_ids)
                assert all(model.state[i] == tm.FULL for i in ids)
                model = _forced(model, ids, tm.READING, pid)
                mine.extend(ids)
            elif op < 0.9:
                ids = tuple(mine)
                assert real.release_read(pid, list(ids), True, lane, 1) == len(ids)
                model = tm.release(model, pid, ids, lane, 1)
                mine.clear()
            else:  # the holder dies: repair
                real._acquire()
                try:
                    real._repair_locked([pid])
                finally:
                    real._release()
                model = tm.repair(model, pid)
                mine.clear()
            _same(real, model, lanes)


def _forced(model: tm.Table, ids: tuple[int, ...], state: int, pid: int) -> tm.Table:
    states, holders = list(model.state), list(model.holder)
    for i in ids:
        states[i], holders[i] = state, pid
    return model._replace(state=tuple(states), holder=tuple(holders))


def _same(real: SlotTable, model: tm.Table, lanes: int) -> None:
    codes = {EMPTY: tm.EMPTY, WRITING: tm.WRITING, FULL: tm.FULL, READING: tm.READING}
    assert tuple(codes[int(s)] for s in real.state) == model.state
    busy = np.isin(real.state, (WRITING, READING))
    assert [int(h) for h, b in zip(real.holder, busy, strict=True) if b] == [
        h for h, s in zip(model.holder, model.state, strict=True) if s in (tm.WRITING, tm.READING)
    ]
    assert tuple(int(v) for v in real.lane_values(tuple(range(lanes)))) == model.lanes
    assert real.counts()[1] == model.read
