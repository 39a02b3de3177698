"""Recipe: webdataset tar shards feeding a gigashuffle buffer.

    python examples/webdataset_shards.py --write-shards /tmp/wds --shards 8      # make some local shards once
    torchrun --standalone --nproc-per-node=2 examples/webdataset_shards.py --urls '/tmp/wds/shard-{000000..000007}.tar'

Needs the ``webdataset`` package besides gigashuffle (``pip install webdataset``); without it the script says so
in one line and exits with code 2.

What matters:

* ``nodesplitter=None``: writers see a job-wide ``get_worker_info()`` (every writer of every rank) and webdataset's
  default ``workersplitter=split_by_worker`` splits the shard list on it, so each writer of the job reads its own
  shards. ``nodesplitter=wds.split_by_node`` would split twice and every rank would read a fraction of its share
  (``gigashuffle.sources.Chunked`` refuses it), and the default ``single_node_only`` fails under torchrun;
* ``empty_check=False``: with fewer shards than the job's writers (``WORLD_SIZE * num_writers``) some writers get
  no shard; they idle, but webdataset's empty check would raise in them instead;
* ``.decode()`` turns ``.npy``/``.cls`` members into arrays and ints; ``Chunked`` stacks ``--chunk-rows`` samples per
  field into one chunk (``__key__`` and ``__url__`` are left out: they are strings);
* ``shardshuffle``: ``False`` reads shards in order, an int shuffles them per pass with webdataset's own seed.

It prints one JSON line: the ids this rank read, how many writers it has, and the loader's seed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.sources import Chunked


def _require(module: str) -> None:
    """Stop with one line naming the package to install, before an ImportError traceback (or, under torchrun, a
    ChildFailedError per rank with the traceback further up) would."""
    if importlib.util.find_spec(module) is None:
        print(f"{sys.argv[0]} needs the {module!r} package: pip install {module}", file=sys.stderr)
        sys.exit(2)


_require("webdataset")

import webdataset as wds  # noqa: E402


def write_shards(directory: Path, shards: int, rows: int) -> str:
    """``shards`` tar files holding ``rows`` samples in all (``id``, a feature vector ``x``, a label); their URLs."""
    directory.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        with wds.TarWriter(str(directory / f"shard-{shard:06d}.tar")) as sink:
            for i in range(shard * rows // shards, (shard + 1) * rows // shards):
                x = np.array([i, i / 2, -i], dtype=np.float32)
                sink.write({"__key__": f"{i:08d}", "id.cls": i, "x.npy": x, "label.cls": i % 10})
    return str(directory / f"shard-{{000000..{shards - 1:06d}}}.tar")


def rename(sample: dict[str, Any]) -> dict[str, Any]:
    return {"id": sample["id.cls"], "x": sample["x.npy"], "label": sample["label.cls"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--urls", help="shard URLs in webdataset's brace notation")
    parser.add_argument("--write-shards", type=Path, help="write local shards to this directory and exit")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--chunk-rows", type=int, default=16)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--distinct", type=int, default=0, help="stop early once this rank has read this many ids")
    parser.add_argument("--bs", type=int, default=8)
    parser.add_argument("--shuffle-size", type=int, default=256)
    parser.add_argument("--num-writers", type=int, default=2)
    parser.add_argument("--queue", default="wds-recipe")
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    if args.write_shards is not None:
        print(write_shards(args.write_shards, args.shards, args.rows))
        return
    if not args.urls:
        parser.error("give --urls (or --write-shards DIR to make some)")

    config = DataloaderConfig.from_env(  # the rank fields from torchrun's LOCAL_RANK, RANK, ... variables
        bs=args.bs,
        shuffle_size=args.shuffle_size,
        queue_name=args.queue,
        num_writers=args.num_writers,
        num_readers=1,
        redis_url=args.redis_url,
    )
    source = wds.WebDataset(args.urls, nodesplitter=None, shardshuffle=False, empty_check=False).decode()
    dataset = Chunked(source, rows=args.chunk_rows, transform=rename)
    ids: set[int] = set()
    with MultiprocessShuffledDataloader(dataset, config) as loader:
        it = iter(loader)
        for _ in range(args.batches):
            group = next(it)[0]
            if not (group["x"][:, 0] == group["id"].to(group["x"].dtype)).all():
                raise SystemExit(f"torn rows: {group}")
            ids.update(group["id"].tolist())
            if 0 < args.distinct <= len(ids):
                break
        writers = len(loader.child_pids()["writer"])
        print(json.dumps({"rank": config.global_rank, "ids": sorted(ids), "writers": writers, "seed": loader.seed}))


if __name__ == "__main__":
    main()
