"""What a child is given and what it is called: its ``ChildSpec`` (pickled by the trainer, unpickled in the child),
the id it is registered under in Redis, and its process title.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any

from gigashuffle.config import DataloaderConfig
from gigashuffle.procs.messages import Role
from gigashuffle.resumepoint import ResumePoint

log = logging.getLogger(__name__)


class _NoContext(enum.Enum):
    # An enum member, not object(): it stays the same object after the spec is unpickled in the child.
    UNSET = "no training context"


NO_CONTEXT = _NoContext.UNSET  # "no context was given", which None (a valid context) cannot say


@dataclass
class ChildSpec:
    """Everything a child needs, pickled by the trainer and unpickled in the child."""

    role: Role
    index: int
    config: DataloaderConfig
    redis_url: str
    generation: str
    runtime_dir: str
    dataset: Any = None
    context: Any = NO_CONTEXT  # the training context given so far (attach_training_context), if any
    seed: int = 0  # the job's base seed (NOTE [ Seeds ] in procs/seeds.py)
    start: int = 0  # how often the trainer started this writer before: a respawn draws a fresh stream
    # NOTE [ Respawned writers ] and [ Restore before reading ] in procs/resume.py:
    stateful: bool = False  # the dataset has state_dict/load_state_dict: track where commits are
    go: bool = True  # False: hold before committing any row until the trainer sends Go or LoadState
    epoch: int | None = None  # the last loader.set_epoch(), for a writer started after it
    point: ResumePoint = field(default_factory=ResumePoint)  # where a writer starts (gigashuffle/resumepoint.py)
    log_levels: dict[str, int] = field(default_factory=dict)  # the trainer's, at the start: NOTE [ Child logs ]


def proc_name(global_rank: int, role: str, index: int, pid: int) -> str:
    """The id under which a child is registered in Redis (its entry in the queue's ``procs`` hash)."""
    return f"{global_rank}.{role[0]}{index}.{pid}"


def retitle(suffix: str = "", title: str | None = None) -> None:
    try:
        import setproctitle
    except ImportError:
        log.debug("setproctitle is not installed")
        return
    setproctitle.setproctitle((title or setproctitle.getproctitle()) + suffix)
