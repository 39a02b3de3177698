"""A training process for the chaos tests that need a trainer of their own (to SIGKILL it, or as a rival).

``--mode iterate``: build a loader on ``--queue`` (``--redis-url``, else the embedded default), read batches and
check each one; after the first batch write ``<out>/pids.json`` (this process, the loader's children by role, and
every descendant with its start time, the embedded Redis server included), then keep ``<out>/progress`` (the
batch count) current until killed, ``--max-seconds`` pass or ``--stop-file`` exists (checked after each batch).
``--rank``/``--ranks``: one rank of a node of several, sharing its buffer with the others.

``--mode claim``: try to build a loader on the queue and global rank, write ``<out>/claim.json`` with the error
type and message (or ``"ok": true``), close and exit.

Exit codes: 0 done, 2 a torn or duplicated row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import psutil
from chaos_datasets import ChaosDataset, check_batch

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader


def _write_json(path: Path, doc: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _config(args: argparse.Namespace) -> DataloaderConfig:
    return DataloaderConfig(
        bs=args.bs,
        shuffle_size=args.shuffle_size,
        queue_name=args.queue,
        num_writers=2,
        num_readers=1,
        redis_url=args.redis_url,
        local_rank=args.rank,
        global_rank=args.rank,
        local_world_size=args.ranks,
        global_world_size=args.ranks,
    )


def iterate(args: argparse.Namespace, out: Path) -> int:
    loader = MultiprocessShuffledDataloader(ChaosDataset(rows=8), _config(args))
    seen: set[int] = set()
    end = time.monotonic() + args.max_seconds
    try:
        for count, batch in enumerate(loader, start=1):
            for row_id in check_batch(batch, args.bs, args.shuffle_size):
                if row_id in seen:
                    print(f"id {row_id} read twice", file=sys.stderr)
                    return 2
                seen.add(row_id)
            del batch
            if count == 1:
                me = psutil.Process()
                descendants = [[p.pid, p.create_time(), " ".join(p.cmdline())] for p in me.children(recursive=True)]
                _write_json(out / "pids.json", {"trainer": [me.pid, me.create_time()], "roles": loader.child_pids(),
                                                "descendants": descendants})  # fmt: skip
            if count % 5 == 0:
                _write_json(out / "progress.json", {"batches": count})
            if time.monotonic() > end or (args.stop_file is not None and args.stop_file.exists()):
                return 0
    finally:
        loader.close()
    return 0


def claim(args: argparse.Namespace, out: Path) -> int:
    started = time.monotonic()
    try:
        loader = MultiprocessShuffledDataloader(ChaosDataset(rows=8), _config(args))
    except Exception as exc:
        _write_json(out / "claim.json", {"ok": False, "type": type(exc).__name__, "message": str(exc),
                                         "seconds": time.monotonic() - started})  # fmt: skip
        return 0
    loader.close()
    _write_json(out / "claim.json", {"ok": True, "seconds": time.monotonic() - started})
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("iterate", "claim"), default="iterate")
    parser.add_argument("--queue", required=True)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--bs", type=int, default=8)
    parser.add_argument("--shuffle-size", type=int, default=128)
    parser.add_argument("--max-seconds", type=float, default=180.0)
    parser.add_argument("--rank", type=int, default=0, help="this trainer's rank on a node of --ranks ranks")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--stop-file", type=Path, default=None, help="close and exit once this file exists")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return iterate(args, args.out) if args.mode == "iterate" else claim(args, args.out)


if __name__ == "__main__":
    sys.exit(main())
