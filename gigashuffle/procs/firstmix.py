"""Mixing from the first batch: before the node's first read, each writer fills only its share of the threshold.

NOTE [ First mix ]
Readers take nothing below ``min_full_slots`` full slots (``min_mixing`` of the buffer). Without more, the first
writer up filled the buffer to that threshold alone while the others were still starting, and the first few hundred
batches of a fast source all came from it (issue 23: 2 writers, bs 64, ``shuffle_size`` 4096, the first 300-400
batches from one writer in 5 of 7 runs). So until the node's first read, a writer copies at most its share of the
threshold, ``ceil(min_full_slots / W)`` rows, where ``W = num_writers * local_world_size`` is the node's writer count
(the ranks of a node run the same ``num_writers``, as the writers' job-wide ``get_worker_info()`` already assumes),
then publishes what it copied, gives its reserved slots back and waits. The threshold can then only be reached with
every writer's share in the buffer, so the readers' first batch already mixes all of them, and the readers need
no new signal: their check of ``min_full_slots`` is the check of the mix. The slot table's read counter (its
header, read without the lock) going above zero lifts the cap for good; it is above zero from the start in a writer
respawned later or attached to a buffer that was read before.

A writer whose share of the source is empty (more writers than shards: NOTE [ Empty shares ] in procs/chunks.py)
never writes: as it starts to idle it says so in its entry of the node's process table in Redis (``empty_share``)
and reports ``MixShare`` to its trainer, and a capped writer counts such writers node-wide (one Redis read per
``_EMPTY_POLL_S`` while it waits, none while it copies), so the others' shares grow to ``ceil(min_full_slots / (W -
empty))`` and the first batch comes as soon as they are in. A writer that is late (a slow first download) would
hold the node back for good, so a writer capped for ``DataloaderConfig.first_mix_wait_s`` (10 s by default) lifts
its cap and fills on. A slow start is no fault: it logs a WARNING only if a writer of the node has written no row
for ``max(first_mix_wait_s, STALL_S)`` (each writer's lane in the slot table, NOTE [ Lanes ] in shm/lanes.py, read
without the lock), else an INFO line. Likewise the trainer, still waiting for its first batch, warns only of its
writers that have not written their share and have written no row for that long (their counters pages), never of
slow but progressing ones (trainer/waiting.py); what the wait has filled so far it logs at INFO (trainer/progress.py).
Cost: one header read per backoff step (at most 8 ms) of a capped writer, nothing once the node has read.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable
from typing import Any

from gigashuffle.config import DataloaderConfig
from gigashuffle.errors import GigashuffleError
from gigashuffle.host.pids import pid_alive
from gigashuffle.procs.messages import MixShare
from gigashuffle.shm.lanes import NO_LANE, writer_lanes
from gigashuffle.shm.slottable import SlotTable

log = logging.getLogger(__name__)

_EMPTY_POLL_S = 0.25  # a capped writer counts the node's empty shares (a Redis read) at most this often
_LANE_POLL_S = 0.25  # and looks at the other writers' lanes (their rows) at most this often
STALL_S = 10.0
"""A writer that wrote no row for ``max(first_mix_wait_s, STALL_S)`` is not progressing (a loaded machine can take
seconds to start a writer, which is no fault)."""


def stall_s(config: DataloaderConfig) -> float:
    """How long without a row makes a writer one to warn about (NOTE [ First mix ])."""
    return max(config.first_mix_wait_s, STALL_S)


Writer = tuple[int, int]  # (local rank, writer index) of a writer of the node


def node_writers(config: DataloaderConfig) -> int:
    """The writers a node expects: every local rank runs ``num_writers``."""
    return config.num_writers * config.local_world_size


def share(config: DataloaderConfig, empty: int = 0) -> int:
    """Rows a writer may copy before the node's first read, ``empty`` of the node's writers having an empty share of
    the source: NOTE [ First mix ]."""
    return math.ceil(config.min_full_slots / max(1, node_writers(config) - empty))


def mark_empty_share(env: Any, empty: bool) -> None:
    """A writer starts (``empty``) or stops idling on an empty share: its entry in the node's process table says
    so, and its trainer counts it as in (NOTE [ First mix ])."""
    env.register(**({"empty_share": True, "local_rank": env.config.local_rank} if empty else {}))
    if empty:
        env.channel.send(MixShare())


def empty_writers(env: Any) -> Callable[[], set[Writer]]:
    """The node's writers idling on an empty share, from the node's process table (NOTE [ First mix ])."""
    host = socket.gethostname()

    def empty() -> set[Writer]:
        out = set()
        for info in env.store.processes().values():
            if info.get("empty_share") and info.get("host") == host and pid_alive(int(info.get("pid", 0))):
                out.add((int(info["local_rank"]), int(info["index"])))
        return out

    return empty


class FirstMix:
    """One writer's cap before the node's first read (NOTE [ First mix ])."""

    def __init__(
        self,
        config: DataloaderConfig,
        table: SlotTable,
        index: int,
        empties: Callable[[], set[Writer]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = table
        self.index = index
        self.config = config
        self.share = share(config)
        self.written = 0
        # first_mix_wait_s=0: no cap at all (it would lift at the first wait, with a warning about late writers).
        self.lifted = node_writers(config) <= 1 or config.first_mix_wait_s == 0 or self._read_started()
        self.reported = False  # MixShare sent to the trainer
        self._capped_since: float | None = None
        self._empties = empties
        self._empty: set[Writer] = set()
        self._clock = clock
        self._next_empty_poll = 0.0
        self._next_lane_poll = 0.0
        # The node's other writers: their lane (NO_LANE: none) and (rows, when they last changed).
        me = (config.local_rank, index)
        every = [(r, i) for r in range(config.local_world_size) for i in range(config.num_writers)]
        self._lanes = {w: writer_lanes(*w)[0] for w in every if w != me}
        self._rows: dict[Writer, tuple[int, float]] = {}

    def _read_started(self) -> bool:
        return self.table.counts()[1] > 0

    def allowed(self, n: int) -> int:
        """How many of the next ``n`` rows this writer may copy now (0: publish, give back and wait)."""
        if self.lifted:
            return n
        left = self.share - self.written
        if left > 0:
            return min(n, left)
        if self._read_started():
            self.lifted = True
            return n
        now = self._clock()
        self._poll(now)
        if self.share > self.written:  # writers with empty shares were counted: this writer's share grew
            return min(n, self.share - self.written)
        if self._capped_since is None:
            self._capped_since = now
        elif now - self._capped_since >= self.config.first_mix_wait_s:
            self.lifted = True
            self._say_lifted(now)
            return n
        return 0

    def _poll(self, now: float) -> None:
        """While capped: count the node's empty shares, note the other writers' rows (NOTE [ First mix ])."""
        if self._empties is not None and now >= self._next_empty_poll:
            self._next_empty_poll = now + _EMPTY_POLL_S
            try:
                self._empty = self._empties()
            except (GigashuffleError, OSError, ValueError, KeyError) as exc:  # Redis away: keep the last count
                log.debug("cannot count the node's empty shares: %s", exc)
            self.share = max(self.share, share(self.config, min(len(self._empty), node_writers(self.config) - 1)))
        if now >= self._next_lane_poll:
            self._next_lane_poll = now + _LANE_POLL_S
            for w, lane in self._lanes.items():
                rows = int(self.table.lanes[lane]) if lane != NO_LANE else -1
                if w not in self._rows or self._rows[w][0] != rows:
                    self._rows[w] = (rows, now)

    def stalled(self, now: float) -> list[Writer]:
        """The node's other writers short of their share that wrote no row for :func:`stall_s` (a writer without
        a lane counts as progressing: nothing tells)."""
        wait = stall_s(self.config)
        return sorted(
            w for w, (rows, since) in self._rows.items()
            if w not in self._empty and 0 <= rows < self.share and now - since >= wait
        )  # fmt: skip

    def _say_lifted(self, now: float) -> None:
        full = self.table.counts()[2].full
        cfg = self.config
        stalled = self.stalled(now)
        if stalled:
            log.warning(
                "writer %d of queue %r rank %d: the buffer has %d of the %d full rows the readers wait for after "
                "%.0f s with this writer's share of %d rows in; writers %s (local rank, index) of the node have "
                "written no row for %.0f s (see their trainers' logs), so this writer fills on without them and the "
                "first batches mix fewer writers",
                self.index, cfg.queue_name, cfg.global_rank, full, cfg.min_full_slots, cfg.first_mix_wait_s,
                self.share, stalled, stall_s(cfg),
            )  # fmt: skip
        else:
            log.info(
                "writer %d of queue %r rank %d: %d of the %d full rows the first batch needs after %.0f s with this "
                "writer's share of %d rows in; the other writers are slower but writing, so this writer fills on",
                self.index, cfg.queue_name, cfg.global_rank, full, cfg.min_full_slots, cfg.first_mix_wait_s,
                self.share,
            )  # fmt: skip

    def wrote(self, n: int) -> None:
        self.written += n

    def share_in(self) -> bool:
        """True once, when this writer's share is written (then the trainer is told)."""
        if self.reported or (not self.lifted and self.written < self.share):
            return False
        self.reported = True
        return True
