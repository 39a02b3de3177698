"""A trainer for test_child_logs.py: its script configures logging (``--configure``) or not; its writers log through
their dataset's own loggers, and writer 1, whose share is empty, through gigashuffle's INFO line for that. It exits
once writer 1 registered its empty share, which it does after that line (procs/chunks.py)."""

from __future__ import annotations

import argparse
import logging
import uuid
from collections.abc import Iterator

from datasets import Chunk, FewShards, take, wait_for

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader


class Chatty(FewShards):
    def __iter__(self) -> Iterator[Chunk]:
        logging.getLogger("mydataset").debug("mydataset debug from the writer")
        logging.getLogger("otherlib").debug("otherlib debug from the writer")
        logging.getLogger("otherlib").warning("otherlib warning from the writer")
        yield from super().__iter__()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--redis-url", required=True)
    p.add_argument("--passes", required=True)
    p.add_argument("--configure", action="store_true")
    args = p.parse_args()
    if args.configure:
        logging.basicConfig(level=logging.INFO)
        logging.getLogger("mydataset").setLevel(logging.DEBUG)
    queue = f"childlogs-{uuid.uuid4().hex[:8]}"
    cfg = DataloaderConfig(bs=4, shuffle_size=32, queue_name=queue, num_writers=2, num_readers=1, writer_max_retries=1,
                           first_mix_wait_s=0, redis_url=args.redis_url)  # fmt: skip
    with MultiprocessShuffledDataloader(Chatty(shards=1, passes_file=args.passes), cfg) as loader:
        take(iter(loader), 3)
        wait_for(lambda: any(p.get("empty_share") for p in loader.processes().values()), "writer 1's empty share")


if __name__ == "__main__":
    main()
