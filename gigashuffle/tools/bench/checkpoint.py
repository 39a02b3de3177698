"""What a checkpoint costs (NOTE [ Checkpoint cut ] in trainer/cut.py): the pause, ``state_dict()``'s latency, the
checkpoint's size and the time to the first batch after a resume, on tiny rows (two int64 fields).

    python -m gigashuffle.tools.bench.checkpoint --shuffle-size 262144 --rounds 3

One rank, 2 writers, 2 readers, a stateful dataset (its state is a row counter). Each round reads ``--batches``
batches, takes ``state_dict()``, saves it with ``torch.save``, then a new loader loads it right after construction
and the time to its first batch is measured. A run without a checkpoint gives the first batch's baseline.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
import uuid
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.trainer.datasetstate import rank_key


class TinyCounter(IterableDataset):  # type: ignore[type-arg]
    """Chunks of ``chunk`` tiny rows (``id``, ``x``: int64); the state is the writer's row counter."""

    def __init__(self, chunk: int) -> None:
        self.chunk, self.pos = chunk, 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = int(state["pos"])

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        info = get_worker_info()
        base = (info.id if info is not None else 0) << 40
        while True:
            ids = torch.arange(self.pos, self.pos + self.chunk, dtype=torch.int64) + base
            self.pos += self.chunk
            yield [{"id": ids, "x": ids * 3}]


def _first_batch_s(cfg: DataloaderConfig, state: dict[str, object] | None) -> float:
    t0 = time.perf_counter()
    with MultiprocessShuffledDataloader(TinyCounter(1024), cfg) as loader:
        if state is not None:
            loader.load_state_dict(state)
        next(iter(loader))
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shuffle-size", type=int, default=262144)
    p.add_argument("--bs", type=int, default=256)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--redis-url", default=None)
    args = p.parse_args()

    def config() -> DataloaderConfig:
        queue = f"bench-ckpt-{uuid.uuid4().hex[:8]}"
        return DataloaderConfig(bs=args.bs, shuffle_size=args.shuffle_size, queue_name=queue, num_writers=2,
                                num_readers=2, redis_url=args.redis_url)  # fmt: skip

    rows: dict[str, list[float]] = {"state_dict_s": [], "pause_s": [], "size_mb": [], "save_s": [], "saved_rows": []}
    resumed, fresh = [], []
    for _ in range(args.rounds):
        fresh.append(_first_batch_s(config(), None))
        cfg = config()  # the resumed loader is of the same queue: a checkpoint of another one is refused
        with MultiprocessShuffledDataloader(TinyCounter(1024), cfg) as loader:
            it = iter(loader)
            for _b in range(args.batches):
                next(it)
            t0 = time.perf_counter()
            state = loader.state_dict()
            rows["state_dict_s"].append(time.perf_counter() - t0)
            rows["pause_s"].append(loader._sup.last_cut_s)
            saved = state[rank_key(loader.config.global_rank)]["rows"]
            rows["saved_rows"].append(float(len(saved["fields"][0])) if saved else 0.0)
            t0 = time.perf_counter()
            blob = io.BytesIO()
            torch.save(state, blob)
            rows["save_s"].append(time.perf_counter() - t0)
            rows["size_mb"].append(blob.tell() / 2**20)
            next(it)  # training goes on after the cut
        blob.seek(0)
        resumed.append(_first_batch_s(cfg, torch.load(blob, weights_only=False)))
    print(
        f"shuffle_size {args.shuffle_size}, bs {args.bs}, 2 writers + 2 readers, tiny rows (16 B), {args.rounds} rounds"
    )
    for name, values in rows.items():
        print(f"  {name:<14} median {statistics.median(values):.4g}  (all: {', '.join(f'{v:.4g}' for v in values)})")
    print(f"  first batch, fresh loader      median {statistics.median(fresh):.3f} s  {[round(v, 3) for v in fresh]}")
    print(
        f"  first batch, resumed loader    median {statistics.median(resumed):.3f} s  {[round(v, 3) for v in resumed]}"
    )


if __name__ == "__main__":
    main()
