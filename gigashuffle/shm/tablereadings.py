"""What a slot table's headers and lanes say, read without its locks (``lane_values``: under every lock), and the
types those readings return (NOTE [ Node lock budget ] in shm/slottable.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from gigashuffle.errors import NodeLockBusy
from gigashuffle.shm.journal import H_CLOCK, H_FULL, H_HELD_NS, H_HOLDS
from gigashuffle.shm.stripes import Stripe


@dataclass(frozen=True)
class LockUsage:
    """How much a node's slot-table locks have been held since its buffer was created: compare two readings over a
    wall-clock interval to see what share of the node's time its transitions took (NOTE [ Node lock budget ] in
    shm/slottable.py). ``held_s`` and ``holds`` total every stripe's lock; ``stripes_held_s`` is each stripe's
    (NOTE [ Stripes ] in shm/stripes.py): the busiest one bounds the node."""

    held_s: float
    holds: int
    stripes_held_s: tuple[float, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class ShuffleBufferStats:
    """Slot counts of a node's buffer: ``full + empty + in_flight == shuffle_size`` once it is allocated."""

    full: int
    empty: int
    in_flight: int


class TableReadings:
    """The part of ``SlotMap`` that reads its figures: its base, not a class of its own."""

    stripes: int
    _stripes: list[Stripe]
    _lanes: npt.NDArray[np.int64]

    if TYPE_CHECKING:

        def _acquire_all(self, wait_s: float | None = None) -> None: ...

        def _release_all(self) -> None: ...

    @property
    def lanes(self) -> npt.NDArray[np.int64]:
        """Every lane's value (NOTE [ Lanes ] in shm/lanes.py): the sum of its cells over the stripes, read without
        the locks (each cell was true at some moment; ``lane_values`` reads them under every lock)."""
        lanes: npt.NDArray[np.int64] = self._lanes[0] if self.stripes == 1 else self._lanes.sum(axis=0)
        return lanes

    def lane_values(self, lanes: tuple[int, ...], wait_s: float | None = None) -> tuple[int, ...]:
        """The values of ``lanes`` (NOTE [ Lanes ] in shm/lanes.py) once any op a dead process was inside is rolled
        forward: the sums of their cells over the stripes, read under every lock. With ``wait_s``, a lock held that
        long (a stopped holder, which rolled forward when it took the lock) is read around, and the values are
        still final: only a process inside an op moves a lane, and that is the stopped holder, which is not the
        dead process asked about."""
        try:
            self._acquire_all(wait_s)
        except NodeLockBusy:
            return tuple(int(self._lanes[:, lane].sum()) for lane in lanes)
        try:
            return tuple(int(self._lanes[:, lane].sum()) for lane in lanes)
        finally:
            self._release_all()

    def lock_usage(self) -> LockUsage:
        """The stripes' locks' total hold time and number of holds, and each stripe's time, without the locks."""
        held = tuple(int(stripe.words[H_HELD_NS]) / 1e9 for stripe in self._stripes)
        return LockUsage(sum(held), sum(int(stripe.words[H_HOLDS]) for stripe in self._stripes), held)

    def full_and_clock(self) -> tuple[int, int]:
        """The full-slot count and the version clock (the sum of the stripes' clocks: about the last version
        handed out, NOTE [ Stripes ]), from the headers without the locks: a reader's metrics sample (NOTE
        [ Child counters ] in shm/counters.py)."""
        stripes = self._stripes
        return sum(s.words[H_FULL] for s in stripes), sum(s.words[H_CLOCK] for s in stripes)

    def lock_holder(self) -> int | None:
        """The pid holding a stripe's lock now (the first such stripe's), or None."""
        for stripe in self._stripes:
            holder = stripe.lock.holder()
            if holder is not None:
                return holder
        return None
