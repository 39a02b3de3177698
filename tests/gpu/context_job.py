"""One rank of the one-context-per-rank check (tests/gpu/test_smoke.py), run by ``python -m torch.distributed.run``.

The rank builds a loader with ``device="cuda"`` without calling ``torch.cuda.set_device``, reads ``--batches``
batches, and, while the loader is still open, writes ``<out>/rank-<RANK>.json`` with its pid, its LOCAL_RANK and
the devices its batches are on; the test then asks ``nvidia-smi`` on which GPUs each pid has a context.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from datasets import UniqueIds

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--hold-s", type=float, default=20.0)
    args = parser.parse_args()
    config = DataloaderConfig.from_env(
        bs=16, shuffle_size=512, queue_name=args.queue, num_writers=1, num_readers=1, redis_url=args.redis_url,
        device="cuda",
    )  # fmt: skip
    rank = int(os.environ.get("RANK", "0"))
    with MultiprocessShuffledDataloader(UniqueIds(), config) as loader:
        it = iter(loader)
        devices = {str(next(it)[0]["x"].device) for _ in range(args.batches)}
        result = {"pid": os.getpid(), "local_rank": config.local_rank, "devices": sorted(devices)}
        (args.out / f"rank-{rank}.json").write_text(json.dumps(result))
        deadline = time.monotonic() + args.hold_s  # stay alive (contexts listed) until the test has looked
        while not (args.out / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.1)


if __name__ == "__main__":
    main()
