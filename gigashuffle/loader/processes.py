"""The loader's processes, for tools and tests: their pids by role, their Redis registry, the wait for their start."""

from __future__ import annotations

import time
from typing import Any

from gigashuffle.errors import GigashuffleError
from gigashuffle.trainer import forks
from gigashuffle.trainer.supervisor import Supervisor

_TURN_POLL_S = 0.05  # how long child_pids() waits for the turn before it looks at the pids again


class ProcessMethods:
    """The part of ``MultiprocessShuffledDataloader`` that lists its processes: its base, not a class of its own."""

    _sup: Supervisor

    def child_pids(self, timeout_s: float = 120.0) -> dict[str, list[int]]:
        """The pids of this loader's live processes by role (``zygote``, ``writer``, ``reader``). The zygote forks
        the children after the constructor returns and reports their pids through the channel: this waits up to
        ``timeout_s`` for every live child's pid, so the lists are complete right after construction too."""
        self.wait_started(timeout_s)
        sup = self._sup
        found: dict[str, list[int]] = {"zygote": [sup.zygote.pid], "writer": [], "reader": []}
        for child in sup.children:
            if child.alive and child.pid is not None:
                found[child.role].append(child.pid)
        return found

    def processes(self) -> dict[str, dict[str, Any]]:
        """Every process of this queue on this node as registered in Redis (role, rank, pid, owner, attach)."""
        return self._sup.session.store.processes()

    def wait_started(self, timeout_s: float = 120.0) -> None:
        """Block until every child has a pid (spawned by the zygote); mostly for tests and tools."""
        sup = self._sup
        forks.refuse_a_copy(sup.config.queue_name, sup.forked_from)  # pumping would read the parent's channels
        deadline = time.monotonic() + timeout_s
        while any(c.pid is None for c in sup.children if c.alive):
            if time.monotonic() > deadline:
                raise GigashuffleError(f"loader processes did not start within {timeout_s}s")
            # Another thread inside next() holds the turn and pumps: the pids come through it. Waiting for its turn
            # outright would wait for its batch, which may need the caller (a test's gate) first.
            if sup.turn.acquire(timeout=_TURN_POLL_S):
                try:
                    sup.pump()
                finally:
                    sup.turn.release()
