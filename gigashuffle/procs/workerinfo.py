"""How a writer becomes a torch DataLoader worker in its dataset's eyes: ``get_worker_info()`` and the seeds.

NOTE [ Worker info ]
Datasets shard themselves on ``torch.utils.data.get_worker_info()`` (Hugging Face ``IterableDataset``,
webdataset and most hand-written ones do), so a writer must answer it as a DataLoader worker would, with ``id``
and ``num_workers`` counting every writer of every rank of the job. torch has no public setter: its worker loop
assigns the private module attribute ``torch.utils.data._utils.worker._worker_info``, which ``get_worker_info()``
returns. This module is the one place that assigns it; should torch rename it, only this file changes, and the
packaging tests (``get_worker_info()`` seen from a real writer) fail first.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils import worker as torch_worker

from gigashuffle.config import DataloaderConfig
from gigashuffle.procs.seeds import writer_seed


def become_worker(config: DataloaderConfig, index: int, dataset: Any, base_seed: int, start: int) -> int:
    """Make ``get_worker_info()`` describe writer ``index`` of this rank among all writers of the job, and seed
    ``random``, numpy and torch with its seed (NOTE [ Seeds ] in procs/seeds.py); returns the worker id."""
    worker_id = config.global_rank * config.num_writers + index
    num_workers = config.global_world_size * config.num_writers
    seed = writer_seed(base_seed, worker_id, num_workers, start)
    random.seed(seed)
    np.random.seed(seed % 2**32)  # numpy's legacy seed takes 32 bits, as torch's docs suggest for workers
    torch.manual_seed(seed)
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
    )
    return worker_id


@contextmanager
def standing_in_for(worker_id: int, num_workers: int, dataset: Any) -> Iterator[None]:
    """``get_worker_info()`` describes writer ``worker_id`` of ``num_workers`` while the block runs in this
    process (the trainer re-reading an old writer's rows: NOTE [ Positions across layouts ] in
    checkpoint/rereads.py), then what it described before (None in a training process). The seeds stay as they are:
    the rows re-read must be a function of the state loaded, as a resume by positions already requires."""
    before = torch_worker._worker_info
    torch_worker._worker_info = torch_worker.WorkerInfo(id=worker_id, num_workers=num_workers, seed=0, dataset=dataset)
    try:
        yield
    finally:
        torch_worker._worker_info = before
