"""Seeds as torch's DataLoader does them: one base seed per job, ``base + worker id`` in each writer.

NOTE [ Seeds ]
The base seed is ``DataloaderConfig.seed`` when given. Otherwise every rank must still agree on it, without a
collective (the loader may be built before ``init_process_group``), so it is derived from what the ranks share:

* under torchrun, ``TORCHELASTIC_RUN_ID`` (a fresh uuid with ``--standalone`` or one node, the ``--rdzv-id`` job
  id otherwise) and ``TORCHELASTIC_RESTART_COUNT``: every rank of every node agrees, and an elastic restart gets
  new streams instead of replaying the first rows;
* otherwise (no torchrun, or a static multi-node rendezvous whose run id is ``none``) the node's session
  generation, which the node's first rank draws at random and every rank of the node quotes from Redis: the
  ranks of a node agree; nodes agree only through an explicit ``seed``.

The queue name is mixed in so that two loaders of one job (train and eval) do not draw the same streams.
A writer's seed is ``base + worker_id + start * num_workers`` (mod 2**63), where ``start`` counts how often the
trainer has started that writer: the first start is exactly torch's ``base + worker_id``, and a respawned writer
gets a stream no other writer of the job uses instead of replaying its predecessor's first rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from gigashuffle.config import SEED_LIMIT, DataloaderConfig

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
_NO_RUN_ID = ("", "none")  # torchrun's default for a static rendezvous: the same for every job


def _digest(*parts: str) -> int:
    text = "\0".join(parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") % SEED_LIMIT


def base_seed(config: DataloaderConfig, generation: str, environ: Mapping[str, str]) -> tuple[int, str]:
    """The job's base seed and where it came from (for the log line), per NOTE [ Seeds ]."""
    if config.seed is not None:
        return config.seed, "DataloaderConfig.seed"
    run_id = environ.get(RUN_ID_ENV, "")
    if run_id not in _NO_RUN_ID:
        restarts = environ.get(RESTART_COUNT_ENV, "0")
        return _digest("run", run_id, restarts, config.queue_name), f"{RUN_ID_ENV}={run_id!r}, restart {restarts}"
    return _digest("session", generation, config.queue_name), f"the session of node {config.node!r}"


def writer_seed(base: int, worker_id: int, num_workers: int, start: int) -> int:
    """The seed of writer ``worker_id`` (job-wide id) on its ``start``-th start (0 for the first)."""
    return (base + worker_id + start * num_workers) % SEED_LIMIT
