"""The trainer's side of NOTE [ Respawned writers ] (procs/resume.py): where each writer's committed rows end.

Per writer index the trainer keeps the ``ResumePoint`` the current writer started from, its recent ``Progress``
reports and a mapping of its commit counter. When the writer dies it turns those into the point its successor
starts from, so that the successor writes exactly the rows its predecessor had not committed.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gigashuffle.errors import CheckpointError
from gigashuffle.procs.messages import Progress
from gigashuffle.procs.positions import filtered_commits
from gigashuffle.procs.resume import COUNTER_BYTES
from gigashuffle.resumepoint import ResumePoint
from gigashuffle.shm.buffer import SharedMemory

# Reports kept per writer: the commit counter lags a report by at most one commit plus the watcher's 10 ms, so
# the newest report at or below it is among the last few (NOTE [ Respawned writers ]).
_KEPT_REPORTS = 32


@dataclass
class _Writer:
    point: ResumePoint = field(default_factory=ResumePoint)  # where the current writer started
    reports: deque[Progress] = field(default_factory=lambda: deque(maxlen=_KEPT_REPORTS))
    counter: SharedMemory | None = None


class ResumePoints:
    def __init__(self, num_writers: int) -> None:
        self._writers = [_Writer() for _ in range(num_writers)]
        self._serials = itertools.count(1)

    def start_of(self, index: int) -> ResumePoint:
        """Where writer ``index`` starts if started now."""
        return self._writers[index].point

    def load(self, points: list[ResumePoint]) -> list[ResumePoint]:
        """``load_state_dict``: each writer starts a new stream from its point, under a new serial; returns the
        points as the writers are to be sent them."""
        for w, point in zip(self._writers, points, strict=True):
            w.point = dataclasses.replace(point, serial=next(self._serials))
            w.reports.clear()
        return [w.point for w in self._writers]

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
        if report.serial == w.point.serial:
            w.reports.append(report)

    def on_death(
        self, index: int, lanes: tuple[int, int], read_lanes: Callable[[tuple[int, ...]], tuple[int, ...] | None]
    ) -> CheckpointError | None:
        """The writer died: where its successor starts (NOTE [ Respawned writers ]). ``lanes``: its lanes,
        ``read_lanes``: their values once any op it died inside is rolled forward (NOTE [ Lanes ]).

        Returns an error when where its committed rows end cannot be known: it attached (so it may have committed
        rows) and its lanes cannot be read. A successor would then repeat or skip rows; the caller stops the
        loader rather than deliver them. (A writer that never attached committed nothing: its channel is drained
        before this is called, so its ``Attached`` would have been seen.)"""
        w = self._writers[index]
        point = w.point
        has_lanes = w.counter is not None and lanes[0] >= 0
        values = read_lanes(lanes) if has_lanes else None
        lost: CheckpointError | None = None
        if has_lanes and values is None:
            lost = CheckpointError(
                f"writer {index} died and the node's slot table cannot be read in this process, so where its "
                "committed rows end is not known: a successor would repeat or skip rows. The loader stops; resume "
                "from the last checkpoint"
            )
        if w.counter is not None and values is not None:
            serial, stream_base, saved_base = (
                int(v) for v in np.frombuffer(w.counter.numpy_view(0, COUNTER_BYTES), np.int64)
            )
            stream_now, saved_now = values
            committed, restored = stream_now - stream_base, saved_now - saved_base
            # With a filter the lane counts rows written, not rows of the stream (procs/positions.py).
            committed, keep, until = filtered_commits(point.base, point.keep, point.until, point.skip, committed)
            if serial == point.serial:  # else it died before it applied the last load_state_dict: start from that
                best = max((r for r in w.reports if r.produced <= committed), key=lambda r: r.produced, default=None)
                # The stream's numbering goes on from the report's state (its filter as the dead writer had it).
                state, produced = (best.state, best.produced) if best is not None else (point.state, 0)
                point = dataclasses.replace(
                    point, state=state, skip=committed - produced, base=point.base + produced, keep=keep,
                    until=until, rows=point.rows.after(restored),
                )  # fmt: skip
        if w.counter is not None:  # without the table's lanes its successor starts where this writer started
            w.counter.close()
            w.counter = None
        w.point = dataclasses.replace(point, serial=next(self._serials))
        w.reports.clear()
        return lost

    def close(self) -> None:
        for w in self._writers:
            if w.counter is not None:
                w.counter.close()
                w.counter = None
