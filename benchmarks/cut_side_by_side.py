"""The checkpoint cut's pause (NOTE [ Checkpoint cut ] in trainer/cut.py) with the old copy of the saved rows (gather
into a temporary per source, then ``np.concatenate``) and today's (each row copied once into place), alternating
on one loader so both meet the same buffer and the same machine load: a side-by-side run in one process.

    PYTHONPATH=$PWD python benchmarks/cut_side_by_side.py --shuffle-size 1048576 --rounds 16 [--redis-url URL]

One rank, 2 writers + 2 readers, tiny rows (two int64 fields, as ``gigashuffle.tools.bench.checkpoint``), bs 256,
100 batches between checkpoints, after a first checkpoint (it faults the buffer in) that counts for neither. Prints
per variant the pause (``last_cut_s``), the copy (``SavedRows.take``, labelled ``saved_rows``) and its parts.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.shm.buffer import SlotBuffer
from gigashuffle.shm.slottable import SlotTable
from gigashuffle.tools.bench.checkpoint import TinyCounter
from gigashuffle.trainer.savedrows import SavedRows

times: dict[tuple[str, str], list[float]] = {}
variant = ["old"]


def old_saved_rows(sup: Any, answers: list[Any], *, copy_buffer: bool) -> dict[str, Any]:
    """``_saved_rows`` as it was: every source copied into its own arrays, then all concatenated (two copies)."""
    table = sup.table() if copy_buffer else None
    parts: list[list[Any]] = []
    layout_json = ""
    for answer in answers:
        if answer.rows and len(answer.rows[0]):
            parts.append([np.asarray(f) for f in answer.rows])
            layout_json = answer.layout_json
    if table is not None:
        buffer = sup.node_table.rows()
        layout_json = buffer.layout.to_json()
        ids = table.full_ids()
        out = [np.empty((len(ids), spec.row_bytes), dtype=np.uint8) for spec in buffer.layout.fields]
        buffer.gather(ids, out)
        parts.append(out)
    for child, k in sup.inbox.waiting():
        fields, _index = child.ring.regions(k)
        parts.append([f.numpy().copy() for f in fields])
        layout_json = layout_json or child.ring.layout.to_json()
    if not parts:
        return {}
    return {"layout": layout_json, "fields": [torch.from_numpy(np.concatenate(c)) for c in zip(*parts, strict=True)]}


def timed(f: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            times.setdefault((variant[0], label), []).append(time.perf_counter() - start)

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shuffle-size", type=int, default=1048576)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--redis-url", default=None)
    args = p.parse_args()

    def old_take(_self: Any, sup: Any, answers: list[Any], *, copy_buffer: bool) -> dict[str, Any]:
        return old_saved_rows(sup, answers, copy_buffer=copy_buffer)

    variants = {"old": timed(old_take, "saved_rows"), "new": timed(SavedRows.take, "saved_rows")}
    SlotTable.full_ids = timed(SlotTable.full_ids, "full_ids")  # type: ignore[method-assign]
    SlotBuffer.gather = timed(SlotBuffer.gather, "gather")  # type: ignore[method-assign]
    cfg = DataloaderConfig(bs=256, shuffle_size=args.shuffle_size, queue_name=f"cutbench-{uuid.uuid4().hex[:6]}",
                           num_writers=2, num_readers=2, redis_url=args.redis_url)  # fmt: skip
    rows: dict[str, list[float]] = {"old": [], "new": []}
    with MultiprocessShuffledDataloader(TinyCounter(1024), cfg) as loader:
        it = iter(loader)
        for _ in range(100):
            next(it)
        variant[0] = "warm-up"  # the first cut faults the buffer into the trainer: counted for neither variant
        loader.state_dict()
        for r in range(args.rounds):
            variant[0] = ("old", "new")[r % 2]
            SavedRows.take = variants[variant[0]]  # type: ignore[method-assign]
            for _ in range(100):
                next(it)
            saved = loader.state_dict()[f"rank{cfg.global_rank}"]["rows"]
            times.setdefault((variant[0], "pause"), []).append(loader._sup.last_cut_s)
            rows[variant[0]].append(len(saved["fields"][0]) if saved else 0)
    print(f"shuffle_size {args.shuffle_size}, {args.rounds} rounds alternating old/new, 2 writers + 2 readers, bs 256")
    for v in ("old", "new"):
        print(f"  {v}: rows saved (k) {' '.join(str(n // 1000) for n in rows[v])}")
    for label in ("pause", "saved_rows", "full_ids", "gather"):
        for v in ("old", "new"):
            ms = [x * 1000 for x in times.get((v, label), [])]
            each = " ".join(f"{x:.1f}" for x in ms)
            print(f"  {label:<11} {v}: median {statistics.median(ms):6.1f} ms, max {max(ms):6.1f}  ({each})")


if __name__ == "__main__":
    main()
