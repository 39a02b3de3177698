"""Recipe: webdataset tar shards feeding a gigashuffle buffer, with exact, elastic checkpoints.

    python examples/webdataset_shards.py --write-shards /tmp/wds --shards 8      # make some local shards once
    torchrun --standalone --nproc-per-node=2 examples/webdataset_shards.py --urls '/tmp/wds/shard-{000000..000007}.tar'

Reading needs nothing besides gigashuffle: ``gigashuffle.sources.Sharded`` with ``TarReader`` reads webdataset's tar
format itself (Python's ``tarfile``), grouping members into samples and decoding ``.npy``/``.cls``/``.txt``/``.json``
as webdataset's ``.decode()`` does. Writing the shards (``--write-shards``) and ``--pipeline`` need the ``webdataset``
package (``pip install webdataset``); without it the script says so in one line and exits with code 2.

What matters:

* ``Sharded(shards, TarReader(transform=...), rows=...)``: writer ``g`` of the job's ``G`` (every writer of every
  rank) reads the shards ``s % G == g``, every sample once per pass; its state is a cursor per shard, so
  ``loader.state_dict()`` resumes exactly, on this world size or another one (README: Checkpoints, Data sources);
* ``transform`` maps a sample (``{"__key__", "id.cls": int, "x.npy": array, ...}``) to the row's fields;
* fewer shards than the job's writers (``WORLD_SIZE * num_writers``) leaves some writers without a shard: they idle;
* ``--pipeline`` reads through a webdataset pipeline in ``Chunked`` instead (``nodesplitter=None``,
  ``empty_check=False``, ``.decode()``): the same rows, but a webdataset pipeline has no state, so that form cannot
  checkpoint (``loader.state_dict()`` raises a ``CheckpointError`` naming the ``Sharded`` form).

``--resume PATH`` loads a checkpoint right after building the loader; ``--save PATH`` saves ``loader.state_dict()``
after the last batch (``PATH`` gets ``.rank<N>``). It prints one JSON line: the ids this rank read, how many writers
it has, and the loader's seed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.sources import Chunked, Sharded, TarReader


def _require(module: str) -> None:
    """Stop with one line naming the package to install, before an ImportError traceback (or, under torchrun, a
    ChildFailedError per rank with the traceback further up) would."""
    if importlib.util.find_spec(module) is None:
        print(f"{sys.argv[0]} needs the {module!r} package: pip install {module}", file=sys.stderr)
        sys.exit(2)


def write_shards(directory: Path, shards: int, rows: int) -> str:
    """``shards`` tar files holding ``rows`` samples in all (``id``, a feature vector ``x``, a label); their URLs."""
    _require("webdataset")
    import webdataset as wds

    directory.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        with wds.TarWriter(str(directory / f"shard-{shard:06d}.tar")) as sink:
            for i in range(shard * rows // shards, (shard + 1) * rows // shards):
                x = np.array([i, i / 2, -i], dtype=np.float32)
                sink.write({"__key__": f"{i:08d}", "id.cls": i, "x.npy": x, "label.cls": i % 10})
    return str(directory / f"shard-{{000000..{shards - 1:06d}}}.tar")


def rename(sample: dict[str, Any]) -> dict[str, Any]:
    return {"id": sample["id.cls"], "x": sample["x.npy"], "label": sample["label.cls"]}


def expand(urls: str) -> list[str]:
    """Local paths from webdataset's brace notation (``shard-{000000..000007}.tar``; several braces multiply)."""
    found = re.search(r"\{(\d+)\.\.(\d+)\}", urls)
    if found is None:
        return [urls]
    first, last = found.group(1), found.group(2)
    return [
        path
        for n in range(int(first), int(last) + 1)
        for path in expand(urls[: found.start()] + str(n).zfill(len(first)) + urls[found.end() :])
    ]


def dataset_of(args: argparse.Namespace) -> Any:
    if not args.pipeline:  # checkpoints exactly and elastically
        return Sharded(expand(args.urls), TarReader(transform=rename), rows=args.chunk_rows, shuffle_shards=False)
    _require("webdataset")
    import webdataset as wds

    source = wds.WebDataset(args.urls, nodesplitter=None, shardshuffle=False, empty_check=False).decode()
    return Chunked(source, rows=args.chunk_rows, transform=rename)  # no checkpoint: a pipeline has no state


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
    parser.add_argument("--pipeline", action="store_true", help="read through a webdataset pipeline (no checkpoint)")
    parser.add_argument("--resume", help="a checkpoint of --save to load right after building the loader")
    parser.add_argument("--save", help="save loader.state_dict() to this path + .rank<N> after the last batch")
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
    ids: set[int] = set()
    with MultiprocessShuffledDataloader(dataset_of(args), config) as loader:
        if args.resume:
            loader.load_state_dict(torch.load(f"{args.resume}.rank{config.global_rank}", weights_only=False))
        it = iter(loader)
        for _ in range(args.batches):
            group = next(it)[0]
            if not (group["x"][:, 0] == group["id"].to(group["x"].dtype)).all():
                raise SystemExit(f"torn rows: {group}")
            ids.update(group["id"].tolist())
            if 0 < args.distinct <= len(ids):
                break
        if args.save:
            torch.save(loader.state_dict(), f"{args.save}.rank{config.global_rank}")
        writers = len(loader.child_pids()["writer"])
        print(json.dumps({"rank": config.global_rank, "ids": sorted(ids), "writers": writers, "seed": loader.seed}))


if __name__ == "__main__":
    main()
