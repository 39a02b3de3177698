"""Recipe: a Hugging Face ``datasets`` IterableDataset feeding a gigashuffle buffer.

    torchrun --standalone --nproc-per-node=2 examples/hf_datasets.py --batches 100

Needs the ``datasets`` package besides gigashuffle (``pip install datasets``); without it the script says so
in one line and exits with code 2.

The data is built here (``Dataset.from_dict``) so that the recipe runs offline; with real data use
``load_dataset(..., streaming=True)`` or ``Dataset.to_iterable_dataset(num_shards=...)`` the same way. What matters:

* pass the whole, *unsplit* IterableDataset. Writers see a job-wide ``get_worker_info()`` (every writer of every
  rank), and the IterableDataset splits its shards on it, so each writer of the job reads its own shards. Do not
  also call ``split_dataset_by_node``: the data would be split twice and every rank would read a fraction of its
  share (``gigashuffle.sources.Chunked`` refuses such a dataset);
* give it at least as many shards as the job has writers (``WORLD_SIZE * num_writers``); a writer left without a
  shard idles instead of failing, but it reads nothing;
* ``Chunked`` groups the per-sample dicts into chunks of ``--chunk-rows`` rows and stacks each field
  (``with_format("torch")`` or ``"numpy"`` gives arrays; plain Python numbers work too);
* checkpoints: ``loader.state_dict()`` holds each writer's ``IterableDataset.state_dict()`` and resumes exactly on
  the same world size and ``num_writers`` (not on another: use ``Sharded`` + ``ParquetReader`` for that), as long
  as the source is not ``.shuffle()``d (its shuffle buffer is not in its state; gigashuffle shuffles already).
  docs/data-sources.md says what each recipe guarantees.

It prints one JSON line: the ids this rank read, the worker ids they came from, and the loader's seed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.sources import Chunked


def _require(module: str) -> None:
    """Stop with one line naming the package to install, before an ImportError traceback (or, under torchrun, a
    ChildFailedError per rank with the traceback further up) would."""
    if importlib.util.find_spec(module) is None:
        print(f"{sys.argv[0]} needs the {module!r} package: pip install {module}", file=sys.stderr)
        sys.exit(2)


_require("datasets")

from datasets import Dataset  # noqa: E402


def build_source(rows: int, shards: int) -> object:
    """A local stand-in for a streamed dataset: ``id`` (the row number), a feature vector ``x`` and a label."""
    table = {
        "id": list(range(rows)),
        "x": [[float(i), float(i) / 2, -float(i)] for i in range(rows)],
        "label": [i % 10 for i in range(rows)],
    }
    return Dataset.from_dict(table).with_format("torch").to_iterable_dataset(num_shards=shards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--chunk-rows", type=int, default=16)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--distinct", type=int, default=0, help="stop early once this rank has read this many ids")
    parser.add_argument("--bs", type=int, default=8)
    parser.add_argument("--shuffle-size", type=int, default=256)
    parser.add_argument("--num-writers", type=int, default=2)
    parser.add_argument("--queue", default="hf-recipe")
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()

    config = DataloaderConfig.from_env(  # the rank fields from torchrun's LOCAL_RANK, RANK, ... variables
        bs=args.bs,
        shuffle_size=args.shuffle_size,
        queue_name=args.queue,
        num_writers=args.num_writers,
        num_readers=1,
        redis_url=args.redis_url,
    )
    dataset = Chunked(build_source(args.rows, args.shards), rows=args.chunk_rows, fields=("id", "x", "label"))
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
