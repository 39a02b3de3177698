"""What a trainer waiting for batches finds out: the node buffer's state for a long wait's warning, a lock holder that
is stopped, writers stalled before the node's first mix (NOTE [ First mix ] in procs/firstmix.py), and a node that can
have no row at all (NOTE [ Empty shares ] in procs/chunks.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gigashuffle.config import DataloaderConfig
from gigashuffle.errors import SchemaError
from gigashuffle.host.pids import describe_process, is_stopped
from gigashuffle.procs.firstmix import node_writers, share, stall_s
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.shm.counters import W_ROWS
from gigashuffle.shm.slottable import ShuffleBufferStats
from gigashuffle.trainer.supervisor import Supervisor

log = logging.getLogger(__name__)


class StalledWriters:
    """Which writers a trainer waiting for its first batch should warn about: those whose rows (``None``: not known
    yet, as 0) have not changed for ``stall_s``, each once (NOTE [ First mix ] in procs/firstmix.py). The clock starts
    at the first check, i.e. the first wait: a loader built long before it was first iterated has no stalled
    writer for that alone."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self.clock = clock
        self._started: float | None = None
        self._seen: dict[int, tuple[int, float]] = {}  # writer -> (rows, since when)
        self._warned: set[int] = set()

    def check(self, rows: dict[int, int | None]) -> list[int]:
        """The writers of ``rows`` (writer -> rows written so far) stalled for ``stall_s`` and not warned of yet."""
        now = self.clock()
        if self._started is None:
            self._started = now
        out = []
        for writer, n in sorted(rows.items()):
            count = n or 0
            last = self._seen.get(writer)
            if last is None or last[0] != count:
                self._seen[writer] = (count, self._started if last is None and count == 0 else now)
            elif now - last[1] >= self.stall_s and writer not in self._warned:
                self._warned.add(writer)
                out.append(writer)
        return out


EMPTY_NODE_S = 10.0
"""How long every writer of the node must have idled on an empty share, with no buffer published, before a trainer
waiting for its first batch calls the node's data empty (NOTE [ Empty shares ] in procs/chunks.py)."""


class EmptyNode:
    """A trainer waiting for its first batch, on a node none of whose writers has a row to write: every writer of the
    node idles on an empty share (its ``__iter__`` ended ``writer_max_retries + 1`` times in a row without a chunk)
    and none published the buffer. That wait could only end in the writers' own error, ``_EMPTY_SHARE_GRACE_S`` into
    their idling; the trainer fails instead, once it has seen it for ``EMPTY_NODE_S`` (a writer given a state or a
    context meanwhile leaves the idle set, and the clock starts again)."""

    def __init__(self, config: DataloaderConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._since: float | None = None

    def check(self, published: bool, empty: int) -> None:
        """``empty``: the node's writers idling on an empty share now; ``published``: whether a buffer is."""
        cfg = self.config
        writers = node_writers(cfg)
        if published or empty < writers:
            self._since = None
            return
        now = self.clock()
        if self._since is None:
            self._since = now
        if now - self._since < EMPTY_NODE_S:
            return
        raise SchemaError(
            f"queue {cfg.queue_name!r} rank {cfg.global_rank}: no batch can come: every writer of node {cfg.node!r} "
            f"({writers}: num_writers={cfg.num_writers} x local_world_size={cfg.local_world_size}) found its share "
            f"of the dataset empty (its __iter__ ended writer_max_retries+1={cfg.writer_max_retries + 1} times in a "
            "row without yielding a chunk), and none wrote a row. The dataset is empty (a file list or a path that "
            "matches nothing?), or its shards are fewer than the job's writers and none fell to this node; add "
            "shards or use fewer writers"
        )


def counts(sup: Supervisor) -> ShuffleBufferStats:
    """The slot counts from the table's header, without its lock (they never wait: NOTE [ A stopped lock holder ])."""
    table = sup.table()
    return ShuffleBufferStats(0, 0, 0) if table is None else table.counts()[2]


def buffer_state(sup: Supervisor) -> str:
    """What a trainer waiting long for a batch says of the node's buffer."""
    cfg = sup.config
    if sup.table() is None:
        return (
            f"no buffer yet: no writer of node {cfg.node!r} has produced its first chunk (a slow source, or a "
            "dataset whose __iter__ has not yielded yet)"
        )
    return f"buffer {counts(sup)} (readers wait for {cfg.min_full_slots} full slots)"


def stopped_lock_holder(sup: Supervisor) -> str:
    table = sup.table()
    holder = None if table is None else table.lock_holder()
    if holder is None or not is_stopped(holder):
        return ""
    return f"; the node's slot-table lock is held by {describe_process(holder)}"


def log_stalled_writers(sup: Supervisor, stalls: StalledWriters) -> None:
    """Warn of this rank's writers short of their first-mix share that wrote no row for first_mix_wait_s; slow
    but progressing writers are no fault (NOTE [ First mix ] in procs/firstmix.py)."""
    late = set(sup.late_writers())
    rows = {c.index: rows_of(c) for c in sup.writers() if c.index in late}
    stalled = stalls.check(rows)
    if stalled:
        cfg = sup.config
        log.warning(
            "queue %r rank %d: writers %s have written no row for %.0f s and not their share (%d rows) of the "
            "node's first mix; the first batch waits for every writer's share, but a writer whose share is in waits "
            "at most %.0f s for the others (NOTE [ First mix ] in procs/firstmix.py)",
            cfg.queue_name, cfg.global_rank, stalled, stall_s(cfg), share(cfg), cfg.first_mix_wait_s,
        )  # fmt: skip


def rows_of(child: ChildProcess) -> int | None:
    """Rows a writer took from its dataset so far (its counters page), None before it mapped one."""
    return None if child.counters is None else int(child.counters.read()[W_ROWS])


def full_slots(sup: Supervisor) -> int:
    sup.raise_if_failed()
    return counts(sup).full
