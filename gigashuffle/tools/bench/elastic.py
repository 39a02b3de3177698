"""What resuming a checkpoint on another ``num_writers`` costs (NOTE [ Elastic resume ] in checkpoint/elastic.py), for
each way of ``checkpoint_rows``, against resuming on the same layout:

    python -m gigashuffle.tools.bench.elastic --shuffle-size 262144 --rounds 2

Shards of tiny rows (``id`` int64, ``x`` float32[16]: 72 B) in a temporary directory, read by
``gigashuffle.sources.Sharded``; one rank, 2 writers, 2 readers, bs 1024. A loader reads ``--batches`` batches and
takes a checkpoint; a new loader of the same queue, with ``--writers-after`` writers or 2, is given it right after
construction. Timed: its ``load_state_dict()`` (elastic by positions, the training process re-reads there the
rows each old writer still owed: NOTE [ Positions across layouts ] in checkpoint/rereads.py) and its first batch.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.checkpoint.parts import rank_key
from gigashuffle.sources.shards import PtReader, Sharded

_BS, _CHUNK = 1024, 1024


def make_shards(folder: Path, shards: int, rows: int) -> list[str]:
    paths = []
    for s in range(shards):
        ids = torch.arange(s * rows, (s + 1) * rows, dtype=torch.int64)
        path = folder / f"shard-{s:03d}.pt"
        torch.save({"id": ids, "x": torch.rand(rows, 16)}, path)
        paths.append(str(path))
    return paths


def one_resume(paths: list[str], shuffle: int, batches: int, way: str, after: int) -> dict[str, float]:
    """A checkpoint of a 2-writer loader resumed by one of ``after`` writers: sizes and times."""
    queue = f"bench-elastic-{uuid.uuid4().hex[:8]}"

    def config(writers: int) -> DataloaderConfig:
        return DataloaderConfig(bs=_BS, shuffle_size=shuffle, queue_name=queue, num_writers=writers, num_readers=2,
                                checkpoint_rows=way)  # fmt: skip

    with MultiprocessShuffledDataloader(Sharded(paths, PtReader(), _CHUNK), config(2)) as loader:
        it = iter(loader)
        for _ in range(batches):
            next(it)
        state = loader.state_dict()
    part = state[rank_key(0)]
    blob = io.BytesIO()
    torch.save(state, blob)
    figures = {
        "size_mb": blob.tell() / 2**20,
        "saved_k": (float(part["rows"]["count"]) if part["rows"] else 0.0) / 1e3,
        "reread_k": sum(len(e["keep"]) for e in part.get("positions") or [] if e is not None) / 1e3,
    }
    t0 = time.perf_counter()
    with MultiprocessShuffledDataloader(Sharded(paths, PtReader(), _CHUNK), config(after)) as loader:
        t1 = time.perf_counter()
        loader.load_state_dict(state)
        figures["load_state_dict_s"] = time.perf_counter() - t1
        next(iter(loader))
        figures["first_batch_s"] = time.perf_counter() - t0
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shuffle-size", type=int, default=262144)
    p.add_argument("--shards", type=int, default=12)
    p.add_argument("--rows-per-shard", type=int, default=100_000)
    p.add_argument("--batches", type=int, default=200, help="batches read before the checkpoint")
    p.add_argument("--writers-after", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--way", default="saved,positions")
    args = p.parse_args()
    print(f"{args.shards} shards x {args.rows_per_shard:,} rows, shuffle_size {args.shuffle_size:,}, bs {_BS}, "
          f"{args.batches} batches before the checkpoint, {args.rounds} rounds (values in run order)")  # fmt: skip
    print("| way | writers | state MB | saved rows k | re-read rows k | load_state_dict() s | first batch s |")
    print("|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        paths = make_shards(Path(folder), args.shards, args.rows_per_shard)
        for way in args.way.split(","):
            for after in (2, args.writers_after):
                runs = [one_resume(paths, args.shuffle_size, args.batches, way, after) for _ in range(args.rounds)]
                print(_row(way, after, runs), flush=True)


def _row(way: str, after: int, runs: list[dict[str, Any]]) -> str:
    def each(name: str, fmt: str) -> str:
        return ", ".join(f"{r[name]:{fmt}}" for r in runs)

    def span(name: str) -> str:
        values = [r[name] for r in runs]
        return f"{min(values):.0f}-{max(values):.0f}" if len(values) > 1 else f"{statistics.mean(values):.0f}"

    cells = [way, f"2 -> {after}", each("size_mb", ".1f"), span("saved_k"), span("reread_k"),
             each("load_state_dict_s", ".2f"), each("first_batch_s", ".2f")]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
