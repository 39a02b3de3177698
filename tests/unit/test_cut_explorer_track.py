"""The explorer's model of the positions way (tests/model/cutmodel.py) against the real code, op by op: a writer's
``Track`` (gigashuffle/procs/positions.py: restart with a filter and a skip folded in, the state kept before each
chunk, the rows a chunk writes, the origins stamped, the answer to a checkpoint), and the trainer's ``_covered``
and ``entry_of`` (the checkpoint's positions module, which is being moved: looked up where it is, skipped if it is
in neither place). The explorer cannot drive the real ``Track`` (it is mutable; a search must copy and remember
worlds), nor the trainer's side (it takes the supervisor's objects), so this is what ties the model to them.
"""

from __future__ import annotations

import importlib
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
from model.cutmodel import (
    Config,
    Writer,
    _before_chunk,
    _entry_of,
    _origins,
    _select,
    _track_answer,
    _track_restart,
    classify,
)

from gigashuffle.procs.positions import LANE_SHIFT, NO_ORIGIN, Track


def _sorted_sample(rng: random.Random, lo: int, hi: int) -> tuple[int, ...]:
    return tuple(sorted(rng.sample(range(lo, hi), rng.randint(0, max(0, min(4, hi - lo))))))


def test_the_track_model_follows_the_real_track() -> None:
    rng = random.Random(32)
    for _run in range(300):
        enabled = rng.random() < 0.8
        lane, keep_rows = rng.randint(0, 3), rng.randint(1, 6)
        cfg = Config(writers=lane + 1, positions=enabled, keep_rows=keep_rows)
        real = Track(enabled, lane, keep_rows)
        base, state, skip = rng.randint(0, 5), rng.randint(0, 50), rng.randint(0, 3)
        keep = _sorted_sample(rng, max(0, base - 2), base + 9) if rng.random() < 0.6 else ()
        until = rng.randint(0, base + 9) if rng.random() < 0.6 else 0
        # writer.run: position.skip_left = track.restart(base, base_state, keep, until, spec.skip)
        left = real.restart(base, state, np.asarray(keep, dtype=np.int64), until, skip)
        c = _track_restart(cfg, Writer(0, lane, 1, 1, skip_left=skip, base=state), (base, keep, until))
        assert c.skip_left == left
        _same(real, c)
        produced = 0
        for _chunk in range(rng.randint(1, 6)):
            # _before_fetch: the state before the chunk (the model's state: rows taken so far, plus the start)
            chunk_state = state + produced
            real.before_chunk(produced, chunk_state)
            c = _before_chunk(cfg, c._replace(produced=produced, chunk_state=chunk_state))
            _same(real, c)
            if rng.random() < 0.3:  # an answer between chunks (or before the first)
                _same_answer(cfg, real, c, started=produced > 0, produced=produced, done=None)
            rows = rng.randint(1, 4)
            skipped = min(c.skip_left, rows)
            chosen = real.select(produced, rows, skipped)
            c, model_chosen = _select(c._replace(skip_left=c.skip_left - skipped), produced, rows, skipped)
            assert model_chosen == (None if chosen is None else tuple(int(j) for j in chosen))
            _same(real, c)
            written = rows - skipped if chosen is None else len(chosen)
            c = c._replace(started=True, produced=produced + rows)
            done = 0 if chosen is not None else skipped
            while True:  # stamp rows in runs, an answer inside the chunk now and then
                if rng.random() < 0.4:
                    _same_answer(cfg, real, c._replace(done=done), started=True, produced=produced + rows, done=done)
                end = written if chosen is not None else rows
                if done >= end:
                    break
                n = rng.randint(1, end - done)
                origin = np.full(8, -7, dtype=np.int64)
                real.stamp(origin, np.arange(n), done, False)
                stamped = _origins(cfg, c._replace(wsaved=False), done, n)
                assert (None if not enabled else tuple(int(o) for o in origin[:n])) == stamped
                if stamped is not None:
                    assert all(o >> LANE_SHIFT == lane for o in stamped)
                done += n
            produced += rows
            c = c._replace(done=None)


def _same(real: Track, c: Writer) -> None:
    assert c.tbase == real.base
    assert c.retained == tuple((int(r), s) for r, s in real.retained)
    assert c.fkeep == tuple(int(k) for k in real.keep)
    assert c.funtil == real.until
    if real.chunk_rows is None:
        assert c.chunk_rows is None
    else:
        assert c.chunk_rows == tuple(int(r) for r in real.chunk_rows)
        assert c.chunk_first == real.chunk_first


def _same_answer(cfg: Config, real: Track, c: Writer, started: bool, produced: int, done: int | None) -> None:
    skip = done if done is not None else c.skip_left  # StreamPosition.answer's skip
    want = real.answer(started, produced, skip, done)
    got = _track_answer(cfg, c._replace(started=started, produced=produced, done=done), skip)
    if want is None:
        assert got is None
        return
    assert got is not None
    at, head, retained, keep, until = got
    assert (at, head, until) == (want["at"], want["head"], want["until"])
    assert retained == tuple((int(r), s) for r, s in want["retained"])
    assert keep == tuple(int(k) for k in want["keep"])


def _trainer_positions() -> Any:
    """The real module the model's ``_covered`` and ``entry_of`` are checked against (an import error fails)."""
    return importlib.import_module("gigashuffle.checkpoint.positions")


def test_classify_follows_the_real_covered() -> None:
    """The model's per-origin decision (found, saved, left to another rank) against ``_covered`` called as
    ``cut_rows`` calls it: on a ring's origins without ``saves``, on the buffer's with this rank's ``saves``."""
    real = _trainer_positions()
    rng = random.Random(32)
    for _run in range(400):
        cfg = Config(trainers=rng.randint(1, 3), writers=rng.randint(1, 3))
        rank = rng.randrange(cfg.trainers)
        own = [rank * cfg.writers + i for i in range(cfg.writers)]
        oldest = {lane: rng.randint(0, 6) for lane in own if rng.random() < 0.7}
        lanes = [-1, *range(cfg.trainers * cfg.writers + 2)]
        origins = [
            NO_ORIGIN if (lane := rng.choice(lanes)) < 0 else (lane << LANE_SHIFT) | rng.randint(0, 10)
            for _ in range(rng.randint(0, 12))
        ]
        array = np.asarray(origins, dtype=np.int64)
        for in_buffer in (False, True):
            found: dict[int, list[Any]] = {lane: [] for lane in oldest}
            if in_buffer:  # cut_rows: saves per lane + 1, the last entry for lanes past the node's
                node_lanes = cfg.trainers * cfg.writers
                saves = np.zeros(node_lanes + 2, dtype=bool)
                saves[own[0] + 1 : own[-1] + 2] = True
                saves[0] = saves[-1] = rank == 0
                want = list(real._covered(array.copy(), oldest, found, saves))
            else:
                want = list(~real._covered(array.copy(), oldest, found))
            model_found: dict[int, list[int]] = {lane: [] for lane in oldest}
            got = [classify(cfg, rank, o, oldest, model_found, in_buffer) for o in origins]
            assert got == [bool(x) for x in want], (cfg, rank, oldest, origins, in_buffer)
            for lane in oldest:
                rows = np.concatenate(found[lane]) if found[lane] else np.empty(0, np.int64)
                assert sorted(int(r) for r in rows) == sorted(model_found[lane])


def test_the_entry_model_follows_the_real_entry_of() -> None:
    """``_entry_of`` against ``entry_of`` on answers with kept states, found rows, a filter's keep and until."""
    real = _trainer_positions()
    rng = random.Random(32)
    for _run in range(400):
        starts = sorted(rng.sample(range(0, 12), rng.randint(0, 3)))
        retained = tuple((r, 100 + r) for r in starts)
        at = rng.choice(starts) if starts and rng.random() < 0.7 else rng.randint(0, 12)
        head = at + rng.randint(0, 4)
        keep = tuple(sorted(rng.sample(range(head, head + 8), rng.randint(0, 3))))
        until = rng.randint(0, head + 8) if rng.random() < 0.5 else 0
        found = tuple(rng.sample(range(starts[0], starts[0] + 10), rng.randint(0, 3))) if starts else ()
        state = 100 + at
        info = {"at": at, "head": head, "retained": list(retained), "keep": np.asarray(keep, np.int64), "until": until}
        if retained:  # positions._found: only a writer with kept states gets the rows found
            info["found"] = [np.asarray(found, dtype=np.int64)]
        want_state, want = real.entry_of(SimpleNamespace(state=state, positions=info))
        message = ("DatasetState", 1, 0, state, 0, (), (at, head, retained, keep, until))
        got_state, skip, entry = _entry_of(Config(), 0, message, {0: found})
        assert (got_state, skip) == (want_state, 0)
        assert entry is not None
        assert entry == (want["at"], tuple(int(k) for k in want["keep"]), want["until"])
