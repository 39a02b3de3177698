"""A dead child, on the trainer's side (NOTE [ Supervision ] in trainer/supervisor.py): the batches a reader released
and never announced, a stateful writer's last commit for the checkpoint package (``Supervisor.on_writer_death``), its
slots repaired and its registry entry dropped; then whether it starts again (within ``max_restarts``, or under the
new session) or the loader stops with an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from gigashuffle.config import DataloaderConfig
from gigashuffle.control.session import NodeSession
from gigashuffle.errors import GigashuffleError, QueueStateLostError, WorkerDied
from gigashuffle.host.rundir import attach_socket_path, remove_socket
from gigashuffle.procs.messages import Role
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.shm.lanes import NO_LANE, reader_lane, writer_lanes
from gigashuffle.trainer.inbox import Inbox
from gigashuffle.trainer.nodetable import TableView

log = logging.getLogger(__name__)

# How long a dead child's lanes wait for the node lock before they are read around a stopped holder.
_LANE_WAIT_S = 1.0

# Lane values once any op a dead child was inside is rolled forward (None: the table is not mapped).
LaneReader = Callable[[tuple[int, ...]], "tuple[int, ...] | None"]
# A writer died: its index, its lanes (NOTE [ Lanes ]) and how to read them; called before its slots are repaired.
# An error returned: its successor cannot start exactly, so the loader stops with it instead of respawning.
DeathHandler = Callable[[int, tuple[int, int], LaneReader], "GigashuffleError | None"]
# Starts a child: its role, index, and how often it was started again after a death.
Spawn = Callable[[Role, int, int], ChildProcess]


class Deaths:
    """What the supervisor does with a child the zygote reported dead; it counts the restarts."""

    def __init__(
        self,
        config: DataloaderConfig,
        session: NodeSession,
        node_table: TableView,
        inbox: Inbox,
        runtime_path: Path,
        stateful: bool,
        children: list[ChildProcess],
        spawn: Spawn,
    ) -> None:
        self.config = config
        self.session = session
        self.node_table = node_table
        self.inbox = inbox
        self.runtime_path = runtime_path
        self.stateful = stateful
        self.children = children  # the supervisor's list: a child started again joins it
        self.spawn = spawn
        self.handlers: list[DeathHandler] = []  # Supervisor.on_writer_death()
        self.restarts = 0  # children started again after a death (for metrics(); rejoins are not restarts)

    def on_exit(self, child: ChildProcess, exitcode: int, closed: bool) -> BaseException | None:
        """After its channel is drained: the error the loader stops with, if any (``closed``: the loader is shutting
        down, so nothing starts again)."""
        if child.role == "reader" and not closed:
            self._recover_batches(child)
        child.exitcode = exitcode
        child.channel.close()
        self.inbox.child_exited()
        if child.pid is not None:
            remove_socket(attach_socket_path(child.pid, self.runtime_path))
        if closed:
            return None
        inexact: GigashuffleError | None = None
        if child.role == "writer" and self.stateful:
            # Before the repair: its successor starts after its last commit (NOTE [ Respawned writers ]).
            lanes = writer_lanes(self.config.local_rank, child.index)
            for handler in self.handlers:
                inexact = inexact or handler(child.index, lanes, self.lane_values)
        self._reclaim(child)
        error = WorkerDied(child.role, child.index, child.pid or -1, exitcode, child.traceback_text,
                           self.config.queue_name)  # fmt: skip
        if child.superseded or child.error_type == "QueueStateLostError":
            saw_newer = child.error_type == "QueueStateLostError" and child.generation == self.session.generation
            if self.session.lost is None and not saw_newer:
                # Its session is gone and we are in the new one (or we killed it in this one): start it now.
                child.superseded = False
                self.children.append(self.spawn(child.role, child.index, child.restarts))
            else:
                # It saw a newer session before (or as) our heartbeat did: the rejoin starts it again.
                child.superseded = True
                if self.session.lost is None:
                    self.session.lost = QueueStateLostError(f"{child.role} {child.index} found: {error}")
        elif inexact is not None and self.config.delivers_once:
            return inexact
        elif child.restarts < self._restart_budget(child) and not child.traceback_text:
            log.warning("%s; restarting it (%d of %d)", error, child.restarts + 1, self.config.max_restarts)
            self.restarts += 1
            self.children.append(self.spawn(child.role, child.index, child.restarts + 1))
        else:
            return error
        return None

    def _recover_batches(self, child: ChildProcess) -> None:
        """Batches the dead reader released and never announced (NOTE [ Lanes ] in shm/lanes.py): its channel is
        drained, so every batch it announced is in the inbox and only these still carry a number."""
        lane = reader_lane(self.config.local_rank, child.index)
        if child.ring is None or lane == NO_LANE or not self.config.delivers_once:
            return
        values = self.lane_values((lane,))
        if values is not None and (found := self.inbox.recover(child, values[0])):
            log.info("reader %d died between releasing and announcing %d batches: delivering them", child.index, found)

    def lane_values(self, lanes: tuple[int, ...]) -> tuple[int, ...] | None:
        """Lane values once any op a dead child was inside is rolled forward; None if the table is not mapped."""
        table = self.node_table.get()
        if table is None:
            log.warning("the node's slot table is not mapped: a dead child's last commit or release is not known")
            return None
        return table.lane_values(lanes, wait_s=_LANE_WAIT_S)

    def _restart_budget(self, child: ChildProcess) -> int:
        # A fill_once reader dies mid-pass with state the trainer cannot replay; fail instead of restarting it.
        if self.config.fill_once and child.role == "reader":
            return 0
        return self.config.max_restarts

    def _reclaim(self, child: ChildProcess) -> None:
        """Repair a dead child's slots in the table, then drop it from the process registry."""
        if child.pid is None:
            return
        self.node_table.repair_reaped(child.proc_id)
        try:
            if child.proc_id:
                self.session.store.unregister(child.proc_id)
        except GigashuffleError as exc:
            log.warning("could not reclaim the slots of %s: %s", child.proc_id, exc)
