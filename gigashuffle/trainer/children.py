"""This rank's children: how they start (through the zygote, each with its spec from ``trainer/childspecs.py``, held
while a checkpoint's cut is on), which are alive, what every writer is told now and at its start, and how they all
stop (NOTE [ Shutdown ] in trainer/teardown.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gigashuffle.host.rundir import attach_socket_path, remove_socket
from gigashuffle.procs.messages import Go, Role, SetContext, SetEpoch, ToChild
from gigashuffle.procs.pickling import dumps_by_value
from gigashuffle.procs.zygoteclient import ChildProcess, Zygote
from gigashuffle.trainer.childspecs import ChildSpecs

log = logging.getLogger(__name__)


class Children:
    """The supervisor's children: ``all`` is the supervisor's list (the inbox and the deaths read it too)."""

    def __init__(self, specs: ChildSpecs, children: list[ChildProcess]) -> None:
        self.config = specs.config
        self.session = specs.session
        self.all = children
        self._starts = specs.starts
        self.specs = specs
        self.reading_began = False  # this rank's iter() or next() said go (a later load_state_dict() is too late)
        self._zygote_title = f"gigashuffle zygote {self.config.queue_name} rank={self.config.global_rank}"
        self.zygote = Zygote(self._zygote_title)

    def start(self) -> None:
        """Start the children a rank starts with."""
        try:
            for role, index in self.specs.every_child():
                self.all.append(self.spawn(role, index, restarts=0))
        except BaseException:
            # E.g. an unpicklable dataset: the loader gets no Supervisor to shut down, so stop the zygote now.
            self.zygote.close()
            for child in self.all:
                child.channel.close()
            raise

    def spawn(self, role: Role, index: int, restarts: int) -> ChildProcess:
        cfg = self.config
        title = f"gigashuffle {role} {cfg.queue_name} rank={cfg.global_rank} proc={index}"
        held = self._starts.held()  # a cut is on: a writer starts held, a reader gets its Pause first
        seq, channel = self.zygote.spawn(self.specs.spec(role, index, held=held is not None), title)
        if role == "reader" and held is not None:
            channel.send(held)  # read before its first draw
        return ChildProcess(role, index, seq, channel, restarts, generation=self.session.generation)

    def writers(self) -> list[ChildProcess]:
        return [c for c in self.all if c.role == "writer" and c.alive]

    def readers(self) -> list[ChildProcess]:
        return [c for c in self.all if c.role == "reader" and c.alive]

    def say_go(self, send: bool = True) -> None:
        """Let writers that hold before reading go on (NOTE [ Restore before reading ]); later ones start going.
        ``send=False``: only later ones (a ``LoadState`` on its way says go to the live ones)."""
        self.reading_began = self.reading_began or send
        if not self.specs.go:
            self.specs.go = True
            if send:
                self.send_to_writers(Go())

    def set_context(self, context: Any) -> None:
        """``attach_training_context``: every writer gets ``context`` now, and writers started later in their spec."""
        self.specs.context = context
        self.send_to_writers(SetContext(context))

    def set_epoch(self, epoch: int) -> None:
        """``set_epoch``: every writer calls ``dataset.set_epoch(epoch)`` now, and writers started later too."""
        self.specs.epoch = epoch
        self.send_to_writers(SetEpoch(epoch))

    def send_to_writers(self, message: ToChild) -> None:
        payload = dumps_by_value(message)  # a context object may be an instance of a class from __main__
        for child in self.writers():
            try:
                child.channel.send_bytes(payload)
            except OSError as exc:
                log.debug("writer %d did not take %s: %s", child.index, type(message).__name__, exc)

    def stop(self, runtime_path: Path) -> bool:
        """Kill every child (through the zygote) and forget them; True when every child is known dead (reaped by the
        zygote)."""
        reaped = self.zygote.close()
        for child in self.all:
            if child.pid is not None:
                remove_socket(attach_socket_path(child.pid, runtime_path))
            if child.alive:
                child.exitcode = -9
                child.channel.close()
        return reaped
