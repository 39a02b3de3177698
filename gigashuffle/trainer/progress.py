"""Filling progress: what a rank waiting for its first batch sees while the buffer fills to ``min_mixing``.

Readers take nothing below ``min_full_slots`` full slots, so the first batch of a job can take minutes on a slow
source; without a word the job looks hung. While the trainer waits for that batch, ``FillProgress`` logs a line
``FIRST_LINE_S`` into the wait and then every ``LOG_INTERVAL_S`` on the logger ``gigashuffle.trainer.progress`` (INFO)
with the rows in, the rows the first batch needs, rows/s and an ETA, and draws a tqdm bar when stderr is a terminal
and tqdm is installed. Logging is never configured here: the application's handlers decide where the lines go; where
the application configured none (Python would drop an INFO line) and no bar is drawn, the lines go to stderr as they
are, so a job under torchrun or in a batch system is not silent while it waits. ``StalledWriters`` picks the writers
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 5.0
"""Seconds between two progress lines (read when a ``FillProgress`` is made)."""
FIRST_LINE_S = 1.0
"""Seconds into the wait of the first line (a start of less shows none)."""
_PROBE_INTERVAL_S = 0.5  # until the table is mapped a probe asks Redis; the wait loop spins far faster than this


def format_eta(seconds: float) -> str:
    if seconds < 1:
        return "< 1 s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:.0f} s"
    return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:.0f} min"


def _tqdm_bar(total: int, desc: str, stream: TextIO) -> Any:
    try:
        tqdm = importlib.import_module("tqdm")  # optional: without it there are only the log lines
    except ImportError:
        return None
    return tqdm.tqdm(total=total, desc=desc, unit="rows", file=stream, leave=False, dynamic_ncols=True, mininterval=0)


class FillProgress:
    """Progress of the buffer towards ``total`` full rows, as reported by ``probe``; call ``update`` often."""

    def __init__(
        self,
        label: str,
        total: int,
        probe: Callable[[], int],
        *,
        bar: bool = True,
        stream: TextIO | None = None,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.total = total
        self.probe = probe
        self.clock = clock
        self.interval_s = LOG_INTERVAL_S if interval_s is None else interval_s
        now = clock()
        self._started = now
        self._first: tuple[float, int] | None = None  # (time, rows) the rate counts from
        self._next_probe = now
        self._next_log = now + min(FIRST_LINE_S, self.interval_s)
        self._logged = False
        self._done = False
        self._rows = 0
        stream = sys.stderr if stream is None else stream
        self._stream: TextIO | None = stream
        self._bar = _tqdm_bar(total, f"gigashuffle {label}: filling", stream) if bar and _is_terminal(stream) else None

    def rate(self, now: float) -> float:
        if self._first is None or now <= self._first[0]:
            return 0.0
        return (self._rows - self._first[1]) / (now - self._first[0])

    def line(self, now: float) -> str:
        """The progress line for ``now`` (rows of total, rows/s, ETA)."""
        rate = self.rate(now)
        left = max(self.total - self._rows, 0)
        eta = format_eta(left / rate) if rate > 0 else "unknown (no rows yet)"
        percent = 100.0 * min(self._rows, self.total) / self.total
        return (
            f"{self.label}: filling the shuffle buffer: {self._rows:,}/{self.total:,} rows ({percent:.1f}%), "
            f"{rate:,.0f} rows/s, ETA {eta}"
        )

    def update(self) -> None:
        """Probe when due, move the bar, and log when a line is due; does nothing once the target was reached."""
        now = self.clock()
        if self._done or now < self._next_probe:
            return
        self._next_probe = now + min(_PROBE_INTERVAL_S, self.interval_s)
        self._rows = self.probe()
        if self._first is None or self._rows == self._first[1]:
            # The rate counts from when rows started to arrive, not from the processes' start-up.
            self._first = (now, self._rows)
        if self._bar is not None:
            self._bar.update(min(self._rows, self.total) - self._bar.n)
        if self._rows >= self.total:
            self.finish()
        elif now >= self._next_log:
            self._say(self.line(now))
            self._logged = True
            self._next_log = now + self.interval_s

    def finish(self, reached: bool = True) -> None:
        """The wait is over: the first batch came (``reached``; said so if progress was shown), or the loader closed.
        Removes the bar."""
        if self._done:
            return
        self._done = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._logged and reached:
            now = self.clock()
            # The first batch came, so the rows are in, though the last probe may have seen none of them (they came
            # between two probes): the rate counts them.
            self._rows = max(self._rows, self.total)
            self._say(
                f"{self.label}: the shuffle buffer reached {self.total:,} full rows (min_mixing) after "
                f"{now - self._started:.1f} s ({self.rate(now):,.0f} rows/s)"
            )

    def _say(self, line: str) -> None:
        """Log ``line`` at INFO; where no handler would show it and no bar is drawn, write it to stderr."""
        log.info("%s", line)
        if self._bar is None and not log.hasHandlers() and self._stream is not None:
            try:
                self._stream.write(f"gigashuffle: {line}\n")
                self._stream.flush()
            except (OSError, ValueError):  # a closed stderr
                pass


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return False
