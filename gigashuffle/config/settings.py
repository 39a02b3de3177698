"""What a config holds: its fields, their defaults, and the values derived from them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True)
class ConfigFields:
    """The fields of a :class:`~gigashuffle.DataloaderConfig` (documented there), apart from its construction so
    that its checks (config/checks.py) can name their type without importing the class that runs them."""

    bs: int
    shuffle_size: int
    queue_name: str
    min_mixing: float = 0.5
    num_writers: int = 2
    num_readers: int = 2
    writer_max_retries: int = 100
    fill_once: bool = False
    evict_on_read: bool = True
    local_rank: int = 0
    global_rank: int = 0
    local_world_size: int = 1
    global_world_size: int = 1
    redis_url: str | None = None
    redis_host: str | None = None
    redis_port: int | None = None
    redis_db: int | None = None
    max_restarts: int = 3
    ring_depth: int | None = None
    lock_stripes: int = 1
    node_id: str | None = None
    redis_timeout_s: float = 30.0
    seed: int | None = None
    pin_memory: bool = False
    device: str | torch.device | None = None
    batch_format: str = "list"
    index_key: bool = True
    steps_per_epoch: int | None = None
    checkpoint_rows: str = "saved"
    first_mix_wait_s: float = 10.0

    @property
    def node(self) -> str:
        """Which node's buffer this rank shares: ranks with the same node share one buffer per queue.

        Defaults to ``global_rank // local_world_size``, which is torchrun's node rank for the homogeneous jobs
        torchrun launches, so two simulated nodes on one machine (``--node-rank 0/1``) stay apart.
        """
        if self.node_id is not None:
            return self.node_id
        return f"n{self.global_rank // self.local_world_size}"

    @property
    def min_full_slots(self) -> int:
        """Full slots a reader needs before it may take a batch (the mixing threshold)."""
        # round() drops float noise: 0.07 * 100 is 7.000000000000001, which must need 7 slots, not 8.
        return max(self.bs, math.ceil(round(self.min_mixing * self.shuffle_size, 9)))

    @property
    def readers_per_node(self) -> int:
        return self.local_world_size * self.num_readers

    @property
    def delivers_once(self) -> bool:
        """Whether each row is delivered once (not ``fill_once``, ``evict_on_read``): the one mode whose checkpoints
        save the rows read and not delivered (NOTE [ Checkpoint cut ] in checkpoint/cut.py); the others save only
        the datasets' positions."""
        return not self.fill_once and self.evict_on_read

    def legacy_redis_url(self) -> str | None:
        """The seed's redis_host/redis_port/redis_db spelled as a URL, when any of them was given."""
        if all(v is None for v in (self.redis_host, self.redis_port, self.redis_db)):
            return None
        host = self.redis_host or "localhost"
        return f"redis://{host}:{self.redis_port or 6379}/{self.redis_db or 0}"
