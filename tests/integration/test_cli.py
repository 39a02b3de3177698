"""``gigashuffle stats`` against a live loader: every queue and node, its slot counts, ranks and rates."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from datasets import UniqueIds

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.cli import queue_rows
from gigashuffle.redisconn import connect


def test_stats_lists_each_queue_with_counts_ranks_and_rates(redis_url: str) -> None:
    config = DataloaderConfig(
        bs=8, shuffle_size=128, queue_name="cli-stats", num_writers=1, num_readers=1, redis_url=redis_url
    )
    stop = threading.Event()
    read = []
    with MultiprocessShuffledDataloader(UniqueIds(), config) as loader:
        batches = iter(loader)
        read.append(next(batches))  # the buffer exists and readers run before we look

        def consume() -> None:
            deadline = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < deadline:
                next(batches)
                read.append(None)

        consumer = threading.Thread(target=consume)
        consumer.start()
        client = connect(redis_url)
        try:
            rows = queue_rows(client, interval_s=0.5)
        finally:
            stop.set()
            consumer.join(timeout=60)
            client.close()
        cli = subprocess.run(
            [sys.executable, "-m", "gigashuffle.cli", "stats", "--redis-url", redis_url, "--json", "--interval", "0"],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
    assert not consumer.is_alive()
    (row,) = rows
    assert (row["queue"], row["node"], row["size"], row["ranks"]) == ("cli-stats", "n0", 128, 1)
    assert row["full"] + row["empty"] + row["in_flight"] == 128
    assert row["processes"] == 2
    assert row["read_per_s"] > 0 and row["written_per_s"] > 0, row
    (listed,) = json.loads(cli.stdout)
    assert listed["queue"] == "cli-stats" and listed["read_per_s"] is None
