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

A writer that is late (a slow first download) or never writes (an empty share: NOTE [ Empty shares ] in
procs/writer.py) would hold the node back for good, so a writer capped for ``DataloaderConfig.first_mix_wait_s``
(10 s by default) lifts its cap and logs how full the buffer is; it reports ``MixShare`` to its trainer when its
share is in, and the trainer, still waiting for its first batch after that long, logs which of its writers have not
(each rank names its own). Cost: one header read per backoff step (at most 8 ms) of a capped writer, nothing once the
node has read.
"""

from __future__ import annotations

import logging
import math
import time

from gigashuffle.config import DataloaderConfig
from gigashuffle.shm.slottable import SlotTable

log = logging.getLogger(__name__)

# How long a writer that has written its share waits for the others before it fills on without them.


def node_writers(config: DataloaderConfig) -> int:
    """The writers a node expects: every local rank runs ``num_writers``."""
    return config.num_writers * config.local_world_size


def share(config: DataloaderConfig) -> int:
    """Rows a writer may copy before the node's first read: NOTE [ First mix ]."""
    return math.ceil(config.min_full_slots / max(1, node_writers(config)))


class FirstMix:
    """One writer's cap before the node's first read (NOTE [ First mix ])."""

    def __init__(self, config: DataloaderConfig, table: SlotTable, index: int) -> None:
        self.table = table
        self.index = index
        self.config = config
        self.share = share(config)
        self.written = 0
        # first_mix_wait_s=0: no cap at all (it would lift at the first wait, with a warning about late writers).
        self.lifted = node_writers(config) <= 1 or config.first_mix_wait_s == 0 or self._read_started()
        self.reported = False  # MixShare sent to the trainer
        self._capped_since: float | None = None

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
        now = time.monotonic()
        if self._capped_since is None:
            self._capped_since = now
        elif now - self._capped_since >= self.config.first_mix_wait_s:
            self.lifted = True
            full = self.table.counts()[2].full
            cfg = self.config
            log.warning(
                "writer %d of queue %r rank %d: the buffer has %d of the %d full rows the readers wait for after "
                "%.0f s with this writer's share of %d rows in; the node's other %d writers are late (see their "
                "trainers' logs), so this writer fills on without them and the first batches mix fewer writers",
                self.index, cfg.queue_name, cfg.global_rank, full, cfg.min_full_slots, cfg.first_mix_wait_s, self.share,
                node_writers(cfg) - 1,
            )  # fmt: skip
            return n
        return 0

    def wrote(self, n: int) -> None:
        self.written += n

    def share_in(self) -> bool:
        """True once, when this writer's share is written (then the trainer is told)."""
        if self.reported or (not self.lifted and self.written < self.share):
            return False
        self.reported = True
        return True
