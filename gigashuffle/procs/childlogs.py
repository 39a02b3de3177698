"""Where a child's log lines go: the trainer's levels, the child's stderr, a prefix naming the child.

NOTE [ Child logs ]
Children are forked from a zygote, a clean interpreter, so none of the logging the training script configured is
there: a child's WARNING went out through Python's last-resort handler as a bare message nobody could place, and its
INFO lines (a writer idling on an empty share, saved rows written back, a rejoin) and the dataset's own log lines
never showed, whatever level the script asked for. So each child starts with the levels its trainer had when it was
started (the root logger's effective level, and every logger's level the script set explicitly, such as a
``logging.getLogger("gigashuffle").setLevel(logging.DEBUG)``) and one handler on its root logger that writes to its
stderr, which is the trainer's, each line naming the child::

    2026-12-08 01:02:03,456 [gigashuffle writer 1, rank 0, pid 4242] INFO gigashuffle.procs.chunks: ...

The script's handlers and formats are not copied: a handler holds open files or sockets of the trainer's, and
several processes writing one file through their own handlers would interleave it. A line is written whole by one
``write`` of the stream (``logging.StreamHandler``), so lines of several children do not mix within a line.
"""

from __future__ import annotations

import logging
import sys

from gigashuffle.procs.messages import Role

Levels = dict[str, int]  # logger name ("" for the root) -> level


def trainer_levels() -> Levels:
    """In the trainer: the levels its children start with (NOTE [ Child logs ])."""
    levels = {"": logging.getLogger().getEffectiveLevel()}
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and logger.level != logging.NOTSET:
            levels[name] = logger.level
    return levels


def configure(levels: Levels, role: Role, index: int, global_rank: int) -> None:
    """In a child, first thing: the trainer's ``levels`` and a stderr handler naming the child."""
    root = logging.getLogger()
    for name, level in levels.items():
        logging.getLogger(name or None).setLevel(level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s [gigashuffle {role} {index}, rank {global_rank}, pid %(process)d] "
            "%(levelname)s %(name)s: %(message)s"
        )
    )
    root.addHandler(handler)
