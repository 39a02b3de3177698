"""The loader's checkpoints: the one object ``state_dict()`` and ``load_state_dict()`` go through.

It is made before the supervisor (which asks it where each writer starts: ``WriterStarts``) and bound to it
after, when it subscribes to the messages the checkpoint protocol needs (``Supervisor.on``): the writers'
answers and the readers' pauses (the cut's, checkpoint/cutstate.py), the writers' commit counters and progress
reports and their deaths (where a successor starts, checkpoint/respawn.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from gigashuffle.checkpoint import parts, positions
from gigashuffle.checkpoint.cutstate import CutState
from gigashuffle.checkpoint.respawn import ResumePoints
from gigashuffle.checkpoint.unconsumed import unconsumed_rows
from gigashuffle.config import DataloaderConfig
from gigashuffle.procs.messages import Attached, DatasetState, Pause, Paused, Progress
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.resumepoint import ResumePoint
from gigashuffle.rowblock import RowBlock
from gigashuffle.trainer.supervisor import Supervisor


class Checkpoints:
    def __init__(self, config: DataloaderConfig) -> None:
        self.config = config
        self.resume = ResumePoints(config.num_writers)
        self.cuts = CutState()
        self._sup: Supervisor | None = None
        self.loaded = False  # a load_state_dict() went through on this loader

    def bind(self, sup: Supervisor) -> None:
        """Hear ``sup``'s events (before its first pump: no message is missed)."""
        self._sup = sup
        sup.on(DatasetState, self.cuts.on_answer)
        sup.on(Paused, self.cuts.on_paused)
        sup.on(Attached, self._on_attached)
        sup.on(Progress, self._on_progress)
        sup.on_writer_death(self.resume.on_death)
        sup.on_close(self.resume.close)

    # -- WriterStarts (trainer/childspecs.py) ----------------------------------------------------------------
    def start_of(self, index: int) -> ResumePoint:
        return self.resume.start_of(index)

    def held(self) -> Pause | None:
        return self.cuts.held()

    # -- the API -----------------------------------------------------------------------------------------------
    def state_dict(self, unconsumed: Sequence[Any] = ()) -> dict[str, Any]:
        """``loader.state_dict()`` (NOTE [ Checkpoint cut ] in checkpoint/cut.py)."""
        sup = self._bound()
        number = self.cuts.next_number()  # first: NOTE [ Node cut ] in control/cutbarrier.py
        handed: list[Any] = []
        if isinstance(unconsumed, (list, tuple)) and self.config.checkpoint_rows == "positions":
            handed, unconsumed = positions.traced(unconsumed, sup)  # views of ring slots: counted by origin
        extra = unconsumed_rows(unconsumed, sup) if unconsumed else RowBlock()
        return parts.collect(sup, self.cuts, self.config, number, extra=extra, handed=handed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``loader.load_state_dict()``: checked in full before any writer is sent anything."""
        parts.restore(self._bound(), self.resume, self.config, state)
        self.loaded = True

    @property
    def last_cut_s(self) -> float:
        """How long the last cut kept this rank's readers from delivering (for the bench); its writers are held
        longer, until every rank of the node copied its rows (``cut_parts["writers_held"]``)."""
        return self.cuts.last_cut_s

    @property
    def cut_parts(self) -> dict[str, float]:
        return self.cuts.cut_parts

    def _bound(self) -> Supervisor:
        if self._sup is None:
            raise AssertionError("Checkpoints used before bind()")
        return self._sup

    def _on_attached(self, child: ChildProcess, _message: Attached, fds: list[int]) -> None:
        if child.role == "writer":
            self.resume.on_attached(child.index, fds)  # its commit counter (NOTE [ Respawned writers ])
        else:
            for fd in fds:
                os.close(fd)

    def _on_progress(self, child: ChildProcess, message: Progress, _fds: list[int]) -> None:
        self.resume.on_report(child.index, message)
