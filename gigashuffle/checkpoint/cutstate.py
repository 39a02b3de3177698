"""What the trainer knows of the checkpoint cut in progress: its number, the writers' answers, the readers that
paused for it, and how long the last one took (NOTE [ Checkpoint cut ] in checkpoint/cut.py)."""

from __future__ import annotations

import time

from gigashuffle.procs.messages import DatasetState, Pause, Paused
from gigashuffle.procs.zygoteclient import ChildProcess


class CutState:
    """One per loader; the supervisor feeds it the writers' ``DatasetState`` and the readers' ``Paused``."""

    def __init__(self) -> None:
        self.number = 0  # state_dict() calls so far: the node barrier's cut number (NOTE [ Node cut ])
        self._pausing = False  # the cut in progress pauses the children (DataloaderConfig.delivers_once)
        self._answers: dict[int, DatasetState] = {}  # writer index -> its answer to the last StateRequest
        # Spawn seqs of readers that answered the current cut's Pause: a Paused of an earlier, aborted cut is
        # dropped, or the next cut would not wait for that reader's batches.
        self._paused: set[int] = set()
        self.last_cut_s = 0.0  # how long the last cut kept this rank's readers from delivering (for the bench)
        self.cut_parts: dict[str, float] = {}  # seconds per phase of the last cut, and the writers' hold (bench)

    def next_number(self) -> int:
        """The next checkpoint's number, taken first in ``state_dict()``, before anything that can raise: every call
        counts on every rank, so a call that fails on one rank (a Redis error, a Ctrl-C) leaves no rank a
        checkpoint behind the others for good."""
        self.number += 1
        return self.number

    def held(self) -> Pause | None:
        """While a pausing cut is on: the ``Pause`` a reader started now gets (and writers start held)."""
        return Pause(self.number) if self._pausing else None

    def begin(self, pause: bool) -> None:
        """The cut of the checkpoint last numbered begins; with ``pause``, children started from now on start held.
        No reader counts as paused for it yet (``on_paused`` takes only this cut's answers from now on)."""
        self._pausing = pause
        self._paused.clear()

    def end(self, started: float, readers_resumed: float | None, parts: dict[str, float]) -> None:
        """The cut that began at ``started`` (``time.monotonic()``) is over: children start unpaused again. Its
        readers went on at ``readers_resumed`` (None: only now); ``parts``: seconds per phase (for the bench)."""
        self._pausing = False
        self._paused.clear()
        ended = time.monotonic()
        self.last_cut_s = (readers_resumed or ended) - started
        self.cut_parts = {**parts, "writers_held": ended - started}

    # -- fed by the supervisor (Supervisor.on) ---------------------------------------------------------------
    def on_answer(self, _child: ChildProcess, message: DatasetState, _fds: list[int]) -> None:
        self._answers[message.index] = message

    def on_paused(self, child: ChildProcess, message: Paused, _fds: list[int]) -> None:
        if message.cut == self.number and self._pausing:
            self._paused.add(child.seq)

    # -- read by the cut -------------------------------------------------------------------------------------
    def answer_of(self, index: int) -> DatasetState | None:
        """Writer ``index``'s answer to the last ``StateRequest`` it answered."""
        return self._answers.get(index)

    def is_paused(self, child: ChildProcess) -> bool:
        """Whether reader ``child`` answered the current cut's ``Pause``."""
        return child.seq in self._paused
