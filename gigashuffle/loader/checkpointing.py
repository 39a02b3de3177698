"""The loader's checkpoint methods: what ``state_dict()`` and ``load_state_dict()`` go through (checkpoint/)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from gigashuffle.checkpoint.checkpoints import Checkpoints
from gigashuffle.config import DataloaderConfig
from gigashuffle.errors import CheckpointError
from gigashuffle.procs.interrupts import critical
from gigashuffle.shm.lanes import NO_LANE, writer_lanes
from gigashuffle.sources import missing_state_methods
from gigashuffle.trainer.supervisor import Supervisor

log = logging.getLogger(__name__)

# How long state_dict()/load_state_dict() wait for a thread inside next() to return (Supervisor.turn): a cut
# that waited for the turn without end would wait for a batch its own pause keeps from coming.
_TURN_WAIT_S = 60.0
_LANES_WAIT_S = 5.0  # a lock held longer (a stopped holder) is read around: tablereadings.py


class CheckpointMethods:
    """The part of ``MultiprocessShuffledDataloader`` that saves and restores it: its base, not a class of its own."""

    config: DataloaderConfig
    dataset: Any
    _checkpoints: Checkpoints
    _sup: Supervisor

    if TYPE_CHECKING:

        def _check_open(self) -> None: ...

    def state_dict(self, unconsumed: Sequence[Any] = ()) -> dict[str, Any]:
        """This rank's checkpoint: ``{f"rank{global_rank}": {...}}`` with the dataset's state in each of its writers
        and the rows read and not handed out (NOTE in checkpoint/parts.py). The dicts of all ranks merge with
        ``dict.update``; a writer that is dead or being started again is waited for (up to a minute), never a
        crash. ``unconsumed``: batches this loader handed out that the caller did not train on (a framework's
        prefetch), as they were yielded; their rows are saved too, so a resume brings them back."""
        self._check_open()
        self._require_state_methods("state_dict")
        with self._turn("state_dict"):
            return self._checkpoints.state_dict(unconsumed)

    def gathered_state_dict(self, unconsumed: Sequence[Any] = ()) -> dict[str, Any]:
        """Every rank's ``state_dict()`` merged (``all_gather_object`` when ``torch.distributed`` is initialized; a
        collective, so every rank must call it), for frameworks that save the loader's state from rank 0 only."""
        mine = self.state_dict(unconsumed)
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return mine
        parts: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, mine)
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part)
        return merged

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's writers from its part, ``state[f"rank{global_rank}"]``, of a checkpoint of the same
        rank layout (merged or not). Called before the first batch, no row of the dataset is read before it (NOTE
        [ Restore before reading ] in procs/resume.py)."""
        self._check_open()
        self._require_state_methods("load_state_dict")
        with self._turn("load_state_dict"):
            written = self._rows_written_unrestored()
            self._checkpoints.load_state_dict(state)
        cfg = self.config
        if self._sup.reading_began:
            log.warning(
                "queue %r rank %d: load_state_dict() came after this loader's first iter(): the rows its writers "
                "put into the node's buffer since then are not the checkpoint's, so some may come twice; load a "
                "checkpoint before the first iter() (NOTE [ Restore before reading ] in procs/resume.py)",
                cfg.queue_name, cfg.global_rank,
            )  # fmt: skip
        elif written:
            log.warning(
                "queue %r rank %d: load_state_dict() came after this writer-only rank's writers put %d rows into "
                "the node's buffer (they do not wait for a checkpoint: num_readers=0), rows the checkpoint does not "
                "know, so some may come twice; load a checkpoint right after constructing the loader",
                cfg.queue_name, cfg.global_rank, written,
            )  # fmt: skip

    def _rows_written_unrestored(self) -> int:
        """Rows a writer-only rank's writers committed before its first ``load_state_dict()``: they never hold for
        one (NOTE [ Restore before reading ] in procs/resume.py), so a late load meets rows it does not know."""
        cfg = self.config
        if cfg.num_readers > 0 or self._checkpoints.loaded:
            return 0
        table = self._sup.table()
        if table is None:
            return 0
        lanes = tuple(writer_lanes(cfg.local_rank, i)[0] for i in range(cfg.num_writers))
        if NO_LANE in lanes:
            return 0
        with critical(blocking=True):  # the node's locks are held only inside: NOTE [ Ctrl-C ]
            return sum(table.lane_values(lanes, wait_s=_LANES_WAIT_S))

    @contextlib.contextmanager
    def _turn(self, caller: str) -> Iterator[None]:
        """The trainer-side state for the whole call (Supervisor.pump()): a call from a second thread waits for the
        one inside ``next()`` to return, and fails rather than waiting for good."""
        if not self._sup.turn.acquire(timeout=_TURN_WAIT_S):
            raise CheckpointError(
                f"{caller}() on the loader of queue {self.config.queue_name!r} waited {_TURN_WAIT_S:.0f} s for "
                "another thread's next() to return: call it from the thread that iterates the loader, between steps"
            )
        try:
            yield
        finally:
            self._sup.turn.release()

    def _require_state_methods(self, caller: str) -> None:
        why = missing_state_methods(self.dataset)
        if why is not None:
            raise CheckpointError(
                f"{caller}: the dataset {type(self.dataset).__name__} of queue {self.config.queue_name!r} cannot be "
                f"checkpointed: {why}"
            )
