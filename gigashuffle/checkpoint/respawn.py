"""The trainer's side of NOTE [ Respawned writers ] (procs/resume.py): where each writer's committed rows end.

Per writer index the trainer keeps the state the current writer started from (``state``, ``skip``, ``serial``), its
recent ``Progress`` reports and a mapping of its commit counter. When the writer dies it turns those into the state
and skip its successor starts from, so that the successor writes exactly the rows its predecessor had not committed.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gigashuffle.procs.messages import Progress
from gigashuffle.procs.positions import filtered_commits
from gigashuffle.procs.resume import COUNTER_BYTES
from gigashuffle.rowblock import NO_ROWS, RowBlock
from gigashuffle.shm.buffer import SharedMemory

# Reports kept per writer: the commit counter lags a report by at most one commit plus the watcher's 10 ms, so
# the newest report at or below it is among the last few (NOTE [ Respawned writers ]).
_KEPT_REPORTS = 32


@dataclass
class _Writer:
    serial: int = 0
    state: Any = None  # None: the dataset as the loader was given it
    skip: int = 0
    reports: deque[Progress] = field(default_factory=lambda: deque(maxlen=_KEPT_REPORTS))
    counter: SharedMemory | None = None
    saved: RowBlock = NO_ROWS  # a checkpoint's rows this writer puts back (NOTE [ Checkpoint cut ])
    # (stream row of ``state``, rows to write, until): NOTE [ Positions checkpoint ] in checkpoint/positions.py
    positions: tuple[int, Any, int] | None = None


class ResumePoints:
    def __init__(self, num_writers: int) -> None:
        self._writers = [_Writer() for _ in range(num_writers)]
        self._serials = itertools.count(1)

    def start_of(self, index: int) -> tuple[Any, int, int, RowBlock]:
        """(state, skip, serial, saved rows) a writer started now starts from."""
        w = self._writers[index]
        return w.state, w.skip, w.serial, w.saved

    def load(self, states: list[Any], skips: list[int], saved: RowBlock) -> list[int]:
        """``load_state_dict``: each writer starts a new stream, writer 0 puts ``saved`` back first; returns the
        serials to send with the states."""
        serials = []
        for i, (w, state, skip) in enumerate(zip(self._writers, states, skips, strict=True)):
            w.serial, w.state, w.skip = next(self._serials), state, skip
            w.saved = saved if i == 0 else RowBlock()
            w.positions = None
            w.reports.clear()
            serials.append(w.serial)
        return serials

    def set_positions(self, starts: list[tuple[int, Any, int] | None]) -> None:
        """A positions checkpoint's start of each writer (after ``load``)."""
        for w, start in zip(self._writers, starts, strict=True):
            w.positions = start

    def positions_of(self, index: int) -> tuple[int, Any, int] | None:
        return self._writers[index].positions

    def on_attached(self, index: int, fds: list[int]) -> None:
        """The writer's commit counter (its memfd came with ``Attached``)."""
        w = self._writers[index]
        if w.counter is not None:
            w.counter.close()
            w.counter = None
        if fds:
            w.counter = SharedMemory(COUNTER_BYTES, fds[0])
            w.counter.close_fd()
            for extra in fds[1:]:
                SharedMemory(COUNTER_BYTES, extra).close()

    def on_report(self, index: int, report: Progress) -> None:
        w = self._writers[index]
        if report.serial == w.serial:
            w.reports.append(report)

    def on_death(
        self, index: int, lanes: tuple[int, int], read_lanes: Callable[[tuple[int, ...]], tuple[int, ...] | None]
    ) -> None:
        """The writer died: where its successor starts (NOTE [ Respawned writers ]). ``lanes``: its lanes,
        ``read_lanes``: their values once any op it died inside is rolled forward (NOTE [ Lanes ])."""
        w = self._writers[index]
        values = read_lanes(lanes) if w.counter is not None and lanes[0] >= 0 else None
        if w.counter is not None and values is not None:
            serial, stream_base, saved_base = (
                int(v) for v in np.frombuffer(w.counter.numpy_view(0, COUNTER_BYTES), np.int64)
            )
            w.counter.close()
            w.counter = None
            stream_now, saved_now = values
            committed, restored = stream_now - stream_base, saved_now - saved_base
            base, keep, until = w.positions or (0, np.empty(0, np.int64), 0)
            # With a filter the lane counts rows written, not rows of the stream (procs/positions.py).
            committed, keep, until = filtered_commits(base, keep, until, w.skip, committed)
            if serial == w.serial:  # else it died before it applied the last load_state_dict: start from that
                w.saved = w.saved.after(restored)
                best = max((r for r in w.reports if r.produced <= committed), key=lambda r: r.produced, default=None)
                if best is not None:
                    w.state, w.skip = best.state, committed - best.produced
                    w.positions = (base + best.produced, keep, until)  # the stream's numbering goes on
                else:
                    w.skip = committed
                    w.positions = (base, keep, until)
        if w.counter is not None:  # the table was not mapped: its successor starts where this writer started
            w.counter.close()
            w.counter = None
        w.serial = next(self._serials)
        w.reports.clear()

    def close(self) -> None:
        for w in self._writers:
            if w.counter is not None:
                w.counter.close()
                w.counter = None
