"""What a checkpoint costs (NOTE [ Checkpoint cut ] in checkpoint/cut.py) on each workload of ``gigashuffle bench``:
the cut's pause, while the readers deliver nothing (a loader's first checkpoint, and the median of its later ones;
its parts, and how long the writers are held, the copy included), ``state_dict()``'s latency, the
checkpoint's size and saved rows, and the time to the first batch of a loader given the checkpoint against that of
a fresh loader.

    python -m gigashuffle.tools.bench.checkpoint --workload tiny --shuffle-size 1048576 --rounds 2
    python -m gigashuffle.tools.bench.checkpoint --workload all --rounds 2

One rank, 2 writers, 2 readers, a stateful dataset that yields the workload's chunk again and again with fresh ids
(its state is the writer's count of chunks). Each round: a fresh loader's dummy batch and first batch (the
baseline); then a loader reads ``--batches`` batches before each of ``--cuts`` checkpoints; the first checkpoint is
saved with ``torch.save``, and a new loader of the same queue loads it right after construction: its dummy batch
and first batch are timed. ``--busy N`` runs N processes spinning on the CPU meanwhile (a node with more
runnable processes than cores). ``--workload counter`` is the 16-byte rows (two int64) of the earlier figures.
``--way saved,positions``: each way of ``DataloaderConfig.checkpoint_rows`` in turn, a row each (NOTE [ Positions
checkpoint ] in checkpoint/positions.py); "re-read k" counts the rows a positions checkpoint has the writers re-read.
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.checkpoint.parts import rank_key
from gigashuffle.tools.bench.workloads import ID_FIELD, WORKLOADS, Chunk, Workload, make_ids


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


class WorkloadCounter(IterableDataset):  # type: ignore[type-arg]
    """A workload's chunk, again and again with fresh ids; the state is the writer's count of chunks."""

    def __init__(self, workload: Workload) -> None:
        self.workload, self.chunks = workload, 0

    def state_dict(self) -> dict[str, int]:
        return {"chunks": self.chunks}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.chunks = int(state["chunks"])

    def __iter__(self) -> Iterator[Chunk]:
        info = get_worker_info()
        writer = info.id if info is not None else 0
        chunk = self.workload.make_chunk(seed=writer)
        rows = self.workload.chunk_rows
        while True:
            chunk[ID_FIELD] = make_ids(writer, self.chunks * rows, rows)
            self.chunks += 1
            yield [chunk]  # the writer copies the rows before it asks for the next chunk


def dataset_of(workload: str) -> IterableDataset:  # type: ignore[type-arg]
    return TinyCounter(1024) if workload == "counter" else WorkloadCounter(WORKLOADS[workload])


def _start(cfg: DataloaderConfig, workload: str, state: dict[str, Any] | None) -> tuple[float, float]:
    """Seconds from building a loader (given ``state`` at once, if any) to its dummy batch and to its first batch."""
    t0 = time.perf_counter()
    with MultiprocessShuffledDataloader(dataset_of(workload), cfg) as loader:
        if state is not None:
            loader.load_state_dict(state)
        loader.get_dummy_batch()
        dummy = time.perf_counter() - t0
        next(iter(loader))
        return dummy, time.perf_counter() - t0


def run(workload: str, shuffle_size: int, bs: int, batches: int, cuts: int, rounds: int, redis_url: str | None,
        way: str = "saved") -> dict[str, list[float]]:  # fmt: skip
    """Every figure of ``rounds`` rounds, by name (seconds, MB, rows)."""

    def config() -> DataloaderConfig:
        return DataloaderConfig(bs=bs, shuffle_size=shuffle_size, queue_name=f"bench-ckpt-{uuid.uuid4().hex[:8]}",
                                num_writers=2, num_readers=2, redis_url=redis_url, checkpoint_rows=way)  # fmt: skip

    out: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        out.setdefault(name, []).append(value)

    for _ in range(rounds):
        dummy, first = _start(config(), workload, None)
        note("dummy_fresh_s", dummy)
        note("first_fresh_s", first)
        cfg = config()  # the resumed loader is of the same queue: a checkpoint of another one is refused
        blob = io.BytesIO()
        with MultiprocessShuffledDataloader(dataset_of(workload), cfg) as loader:
            it = iter(loader)
            for cut in range(cuts):
                for _b in range(batches):
                    next(it)
                t0 = time.perf_counter()
                state = loader.state_dict()
                which = "first" if cut == 0 else "later"
                note(f"state_dict_{which}_s", time.perf_counter() - t0)
                note(f"pause_{which}_s", loader._checkpoints.last_cut_s)
                for part, seconds in loader._checkpoints.cut_parts.items():
                    note(f"part_{part}_s", seconds)
                saved = state[rank_key(cfg.global_rank)]["rows"]
                note("saved_rows", float(saved["count"]) if saved else 0.0)
                where = state[rank_key(cfg.global_rank)].get("positions") or []
                note("reread_rows", float(sum(len(e["keep"]) for e in where if e is not None)))
                if cut == 0:
                    t0 = time.perf_counter()
                    torch.save(state, blob)
                    note("save_s", time.perf_counter() - t0)
                    note("size_mb", blob.tell() / 2**20)
                del state, saved, where
            next(it)  # training goes on after the cut
        blob.seek(0)
        dummy, first = _start(cfg, workload, torch.load(blob, weights_only=False))
        note("dummy_resumed_s", dummy)
        note("first_resumed_s", first)
    return out


COLUMNS = ("workload", "way", "shuffle_size", "row B", "pause first ms", "pause later ms", "state_dict first ms",
           "state_dict later ms", "saved rows k", "re-read k", "size MB", "torch.save s", "dummy fresh / resumed s",
           "first batch fresh / resumed s",
           "pause parts ms: writers / readers / list; then copy; writers held")  # fmt: skip


def row(workload: str, shuffle_size: int, figures: dict[str, list[float]], way: str = "saved") -> str:
    """One markdown table row: medians, and each value of the few first-of-a-loader figures."""

    def each(name: str, scale: float = 1.0, fmt: str = ".0f") -> str:
        return ", ".join(f"{v * scale:{fmt}}" for v in figures.get(name, []))

    def med(name: str, scale: float = 1.0, fmt: str = ".0f") -> str:
        values = figures.get(name)
        return f"{statistics.median(values) * scale:{fmt}}" if values else "-"

    row_bytes = 16 if workload == "counter" else WORKLOADS[workload].row_bytes
    saved, reread = figures["saved_rows"], figures["reread_rows"]
    cells = [workload, way, f"{shuffle_size:,}", str(row_bytes), each("pause_first_s", 1e3), med("pause_later_s", 1e3),
             each("state_dict_first_s", 1e3), med("state_dict_later_s", 1e3),
             f"{min(saved) / 1e3:.0f}-{max(saved) / 1e3:.0f}", f"{min(reread) / 1e3:.0f}-{max(reread) / 1e3:.0f}",
             each("size_mb", 1, ".1f"),
             each("save_s", 1, ".2f"), f"{med('dummy_fresh_s', 1, '.2f')} / {med('dummy_resumed_s', 1, '.2f')}",
             f"{each('first_fresh_s', 1, '.2f')} / {each('first_resumed_s', 1, '.2f')}",
             " / ".join(med(f"part_{part}_s", 1e3, ".1f") for part in ("writers", "readers", "list"))
             + f"; {med('part_copy_s', 1e3, '.1f')}; {med('part_writers_held_s', 1e3, '.1f')}"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=[*WORKLOADS, "counter", "all"], default="tiny")
    p.add_argument("--shuffle-size", type=int, default=None, help="default: the workload's")
    p.add_argument("--bs", type=int, default=None, help="default: the workload's (counter: 256)")
    p.add_argument("--batches", type=int, default=100, help="batches read before each checkpoint")
    p.add_argument("--cuts", type=int, default=4, help="checkpoints per loader (the first maps the buffer)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--way", default="saved", help="checkpoint_rows ways, comma-separated: saved,positions")
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        help="processes spinning on the CPU meanwhile: a node busier than its cores (the pause's waits)",
    )
    args = p.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        _print_table(args)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def _print_table(args: argparse.Namespace) -> None:
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    print(f"2 writers + 2 readers, {args.batches} batches before each of {args.cuts} checkpoints, {args.rounds} rounds")
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS), flush=True)
    for name in names:
        spec = WORKLOADS.get(name)
        shuffle = args.shuffle_size or (spec.shuffle_size if spec else 262144)
        bs = args.bs or (spec.bs if spec else 256)
        for way in args.way.split(","):
            figures = run(name, shuffle, bs, args.batches, args.cuts, args.rounds, args.redis_url, way)
            print(row(name, shuffle, figures, way), flush=True)


if __name__ == "__main__":
    main()
