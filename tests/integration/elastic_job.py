"""One rank of one segment of the elastic checkpoint scenario (tests/integration/test_checkpoint_elastic.py).

Each rank is its own process and its own simulated node (``local_world_size=1``: node ``n<rank>``), so several
ranks run side by side on one machine, each with its own buffer. The dataset is ``sources.Sharded`` over the parquet
shards in ``--shards`` (a unique ``id`` per row, ``pass`` added by the source). A rank builds its loader with
``--world`` ranks and ``--writers`` writers, loads ``--resume`` (a merged checkpoint of every rank of the previous
segment, of another layout) right after construction, reads ``--before`` batches (each row's id and pass to
``<out>.before``), saves ``loader.state_dict()`` to ``--save``, reads ``--after`` batches more (not counted) and
SIGKILLs itself. ``--before 0``: the last segment, reading until every (id, pass) of passes 0 and 1 not in
``--counted`` came, then ``--drain-past`` rows more, within ``--max-seconds``; everything it reads counts.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.sources import ParquetReader, Sharded

PASSES = (0, 1)
SHARD_ROWS = (90, 130, 70, 150, 110, 60, 140, 100, 120)  # 9 shards, 1,070 ids


def write_shards(folder: Path, lengths: tuple[int, ...] = SHARD_ROWS) -> Path:
    folder.mkdir()
    start = 0
    for s, n in enumerate(lengths):
        ids = np.arange(start, start + n, dtype=np.int64) * 7 + 3  # not positions: ids the rows carry
        x = np.stack([ids, -ids], axis=1).astype(np.float32)
        table = pa.table({"id": ids, "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 2)})
        pq.write_table(table, folder / f"shard-{s:02d}.parquet", row_group_size=32)
        start += n
    return folder


def shards_of(folder: str) -> list[str]:
    return sorted(str(p) for p in Path(folder).glob("*.parquet"))


def all_ids(folder: str) -> set[int]:
    return {i for path in shards_of(folder) for i in pq.read_table(path, columns=["id"]).column("id").to_pylist()}


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--redis-url", "--queue", "--out", "--shards"):
        p.add_argument(name, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--writers", type=int, required=True)
    p.add_argument("--local-world", type=int, default=1, help="ranks per simulated node (node = rank // this)")
    p.add_argument("--resume", default="")
    p.add_argument("--save", default="")
    p.add_argument("--before", type=int, default=0)
    p.add_argument("--after", type=int, default=0)
    p.add_argument("--counted", default="")
    p.add_argument("--drain-past", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=240.0)
    p.add_argument("--way", default="saved", help="DataloaderConfig.checkpoint_rows")
    args = p.parse_args()
    cfg = DataloaderConfig(bs=16, shuffle_size=128, queue_name=args.queue, num_writers=args.writers, num_readers=1,
                           redis_url=args.redis_url, global_rank=args.rank, global_world_size=args.world,
                           local_rank=args.rank % args.local_world, local_world_size=args.local_world,
                           max_restarts=3, checkpoint_rows=args.way)  # fmt: skip
    dataset = Sharded(shards_of(args.shards), ParquetReader(), rows=16, seed=7, pass_field="pass")
    loader = MultiprocessShuffledDataloader(dataset, cfg)
    if args.resume:
        loader.load_state_dict(torch.load(args.resume, weights_only=False))
    it = iter(loader)
    deadline = time.monotonic() + args.max_seconds
    with open(args.out + ".before", "w") as before:
        if args.before == 0:  # the last segment: every (id, pass) not counted yet, then a margin for repeats
            counted = {tuple(map(int, line.split())) for line in Path(args.counted).read_text().splitlines()}
            missing = {(i, ps) for i in all_ids(args.shards) for ps in PASSES} - counted
            margin = args.drain_past
            while (missing or margin > 0) and time.monotonic() < deadline:
                group = next(it)[0]
                for i, ps in zip(group["id"].tolist(), group["pass"].tolist(), strict=True):
                    before.write(f"{i} {ps}\n")
                    missing.discard((i, ps))
                    margin -= not missing
            before.flush()
            loader.close()
            return
        for _ in range(args.before):
            group = next(it)[0]
            before.writelines(f"{i} {ps}\n" for i, ps in zip(group["id"].tolist(), group["pass"].tolist()))
        before.flush()
        os.fsync(before.fileno())
    torch.save(loader.state_dict(), args.save + ".tmp")
    os.replace(args.save + ".tmp", args.save)
    for _ in range(args.after):
        next(it)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
