"""Picklable datasets for the dummy-batch, device and progress tests (importable by the writer processes)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import redis
import torch
from datasets import ID_STRIDE, Chunk, unique_chunk
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle.control.keys import QueueKeys

_HOLD_DEADLINE_S = 120.0


class LateWriters(IterableDataset):  # type: ignore[type-arg]
    """``UniqueIds`` whose writers with a worker id in ``late`` hold their first chunk until another writer has
    created the queue's buffer (its metadata exists in Redis), so the race for the buffer is always lost by them.

    ``empty`` worker ids yield nothing at all (an empty share of a sharded source).
    """

    def __init__(
        self, redis_url: str, queue: str, node: str, late: frozenset[int], empty: frozenset[int] = frozenset()
    ) -> None:
        self.redis_url = redis_url
        self.meta_key = QueueKeys(queue, node).meta
        self.late = late
        self.empty = empty

    def __iter__(self) -> Iterator[Chunk]:
        info = get_worker_info()
        wid = info.id if info is not None else 0
        if wid in self.empty:
            return
        if wid in self.late:
            client = redis.Redis.from_url(self.redis_url)
            deadline = time.monotonic() + _HOLD_DEADLINE_S
            while not client.exists(self.meta_key):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"writer {wid}: no other writer created the buffer within {_HOLD_DEADLINE_S}s")
                time.sleep(0.02)
            client.close()
        first = wid * ID_STRIDE
        for n in itertools.count(0, 8):
            yield unique_chunk(torch.arange(first + n, first + n + 8, dtype=torch.int64))
