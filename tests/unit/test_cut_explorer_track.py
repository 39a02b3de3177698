"""The explorer's model of a writer's ``Track`` (tests/model/cutmodel.py, the positions way) against the real one
(gigashuffle/procs/positions.py), op by op: restart (a filter, a skip folded in), the state kept before each chunk,
the rows a chunk writes, the origins stamped, and the answer to a checkpoint. The explorer cannot drive the real
``Track`` (it is mutable; a search must copy and remember worlds), so this is what ties the model to it.
"""

from __future__ import annotations

import random

import numpy as np
from model.cutmodel import Config, Writer, _before_chunk, _origins, _select, _track_answer, _track_restart

from gigashuffle.procs.positions import LANE_SHIFT, Track


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
