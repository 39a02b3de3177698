"""What each child this rank starts is given: its ``ChildSpec`` (config, dataset, seed, resume point, the training
context and epoch so far, whether to hold before reading)."""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from gigashuffle.config import DataloaderConfig
from gigashuffle.control.link import ControlLink
from gigashuffle.procs import childlogs
from gigashuffle.procs.childspec import NO_CONTEXT, ChildSpec
from gigashuffle.procs.messages import Pause, Role
from gigashuffle.procs.pickling import dumps_by_value
from gigashuffle.procs.seeds import base_seed
from gigashuffle.resumepoint import ResumePoint

log = logging.getLogger(__name__)


class WriterStarts(Protocol):
    """What the checkpoint package tells the supervisor about starts (checkpoint/checkpoints.py)."""

    def start_of(self, index: int) -> ResumePoint:
        """Where writer ``index`` starts if started now."""
        ...

    def held(self) -> Pause | None:
        """While a checkpoint's cut is on, the ``Pause`` a reader started now gets (and writers start held)."""
        ...


class ChildSpecs:
    """The specs of this rank's children; the supervisor updates what later starts inherit."""

    def __init__(
        self,
        config: DataloaderConfig,
        dataset: Any,
        link: ControlLink,
        runtime_dir: str,
        stateful: bool,
        starts: WriterStarts,
    ) -> None:
        self.config = config
        self.dataset = dataset
        self.redis_url = link.url
        self.session = link.session
        self.runtime_dir = runtime_dir
        self.stateful = stateful
        self.starts = starts
        # A stateful dataset's writers track their commits and hold before reading until ``say_go()`` (NOTE
        # [ Respawned writers ] and [ Restore before reading ] in procs/resume.py); a feed-only rank never asks.
        self.go = not stateful or config.num_readers == 0
        self.context: Any = NO_CONTEXT  # what attach_training_context() gave last; respawned writers get it too
        self.epoch: int | None = None  # the last set_epoch() the dataset took, for writers started later
        self.seed, origin = base_seed(config, self.session.generation, os.environ)
        log.info(
            "queue %r rank %d: seed %d (from %s); DataloaderConfig(seed=%d) repeats the writers' streams",
            config.queue_name, config.global_rank, self.seed, origin, self.seed,
        )  # fmt: skip
        self._starts: dict[tuple[str, int], int] = {}

    def every_child(self) -> list[tuple[Role, int]]:
        """The children a rank starts with: its writers, then its readers."""
        writers: list[tuple[Role, int]] = [("writer", i) for i in range(self.config.num_writers)]
        readers: list[tuple[Role, int]] = [("reader", i) for i in range(self.config.num_readers)]
        return writers + readers

    def spec(self, role: Role, index: int, held: bool = False) -> bytes:
        """The pickled ``ChildSpec`` of the next start of ``role`` ``index``; ``held``: a checkpoint's cut is on."""
        start = self._starts.get((role, index), 0)
        self._starts[(role, index)] = start + 1
        spec = ChildSpec(
            role=role,
            index=index,
            config=self.config,
            redis_url=self.redis_url,
            generation=self.session.generation,
            runtime_dir=self.runtime_dir,
            dataset=self.dataset if role == "writer" else None,
            context=self.context,
            seed=self.seed,
            start=start,
            stateful=self.stateful,
            go=self.go and not held,
            epoch=self.epoch if role == "writer" else None,
            point=self.starts.start_of(index) if role == "writer" else ResumePoint(),
            log_levels=childlogs.trainer_levels(),
        )
        try:
            return dumps_by_value(spec)
        except Exception as exc:
            raise TypeError(
                f"the dataset {type(self.dataset).__name__} (or the training context) cannot be pickled for "
                f"the writer processes: {exc}; keep open files, sockets, locks and threads out of it until "
                "__iter__ (open them there)"
            ) from exc
