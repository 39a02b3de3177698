"""The entry point the zygote runs in each forked child.

``child_main`` hands over to ``writer.run`` or ``reader.run`` and, if they raise, sends the formatted traceback to
the trainer before exiting, so the trainer can raise it as the child's own error (as torch's ``ExceptionWrapper``
does for DataLoader workers). It lives apart from ``procs/childenv.py`` so that the loops import the shared child code
and nothing imports them back.
"""

from __future__ import annotations

import logging
import pickle
import socket
import traceback

from gigashuffle.procs import childlogs
from gigashuffle.procs.channel import Channel
from gigashuffle.procs.childspec import ChildSpec, retitle
from gigashuffle.procs.messages import ChildError

log = logging.getLogger(__name__)


def child_main(payload: bytes, title: str, control_fd: int) -> int:
    """Run one child; returns its exit code. Errors go to the trainer as text before the child exits."""
    channel = Channel(socket.socket(fileno=control_fd))
    retitle(title=title)
    try:
        spec: ChildSpec = pickle.loads(payload)
        childlogs.configure(spec.log_levels, spec.role, spec.index, spec.config.global_rank)
        import torch

        torch.set_num_threads(1)  # many children per node: one intra-op thread each avoids oversubscription
        if spec.role == "writer":
            from gigashuffle.procs import writer

            writer.run(spec, channel)
        else:
            from gigashuffle.procs import reader

            reader.run(spec, channel)
    except BaseException as exc:
        try:
            channel.send(ChildError(type(exc).__name__, traceback.format_exc()))
        except OSError:
            log.debug("trainer is gone; error not reported")
        return 1
    return 0
