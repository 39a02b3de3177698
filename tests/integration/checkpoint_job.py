"""One segment of the exact-checkpoint scenario (tests/integration/test_checkpoint_exact.py), run as its own process.

The dataset is finite: ``--ids`` unique ids per writer per pass, ``state_dict()`` = its position (pass, pos). A
segment builds the loader, loads ``--resume`` right after construction (as README.md and examples/ do), reads
``--before`` batches writing each row's id and pass to ``<out>.before``, takes ``loader.state_dict()`` into
``--save`` (torch.save), reads ``--after`` more batches (``<out>.after``, not counted: the job "crashes" before
its next checkpoint) and SIGKILLs itself. With ``--kill-writer-at N`` it SIGKILLs writer 0 after N batches.
``--before 0 --counted F --drain-past P``: the last segment, reading until every id of pass 0 not in ``F`` (what
the earlier segments counted) came, then ``P`` rows more (a repeat would show), within ``--max-seconds``; everything
it reads counts. (Its writers may be served unevenly, so a fixed number of rows would not do.)

``--dataset`` picks the source, all with the same ids and a ``pass`` field: ``ids`` (the dataset above), ``hf`` (the
README's Hugging Face recipe: ``Chunked`` over ``load_dataset("parquet", ..., streaming=True)`` of the parquet shards
in ``--data``) or ``tar`` (the webdataset recipe: ``Sharded`` over the tar shards in ``--data`` with ``TarReader``);
:func:`write_shards` makes those shards.

It only uses the public API, so the same file measures the code of another checkout (``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import tarfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader

STRIDE = 10**6


class FiniteIds(IterableDataset):  # type: ignore[type-arg]
    """``ids`` rows per writer per pass: ``id = worker * STRIDE + i``, ``pass``; the state is (pass, pos)."""

    def __init__(self, ids: int, chunk: int) -> None:
        self.ids, self.chunk = ids, chunk
        self.passes, self.pos = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"pass": self.passes, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.passes, self.pos = int(state["pass"]), int(state["pos"])

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        while self.pos < self.ids:
            start, self.pos = self.pos, min(self.pos + self.chunk, self.ids)
            ids = torch.arange(start, self.pos, dtype=torch.int64) + worker * STRIDE
            yield [{"id": ids, "pass": torch.full_like(ids, self.passes)}]
        self.passes, self.pos = self.passes + 1, 0


SHARDS = 4  # files per pass for --dataset hf/tar: at least the job's writers (2), as the recipes ask


def write_shards(kind: str, directory: Path, ids: int) -> None:
    """The ids of a pass (``w * STRIDE + i`` for 2 writers' worth, ``i < ids``) in ``SHARDS`` files in
    ``directory``: parquet (``kind="hf"``) or webdataset tar shards (``"tar"``: ``<key>.id.cls``, ``<key>.x.npy``)."""
    every = [w * STRIDE + i for w in range(2) for i in range(ids)]
    directory.mkdir(parents=True, exist_ok=True)
    for shard in range(SHARDS):
        part = every[shard::SHARDS]
        if kind == "hf":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"id": part}), directory / f"part-{shard}.parquet", row_group_size=7)
            continue
        with tarfile.open(directory / f"shard-{shard}.tar", "w") as tar:
            for i in part:
                x = io.BytesIO()
                np.save(x, np.array([i], dtype=np.int64))
                for name, data in ((f"{i:08d}.id.cls", str(i).encode()), (f"{i:08d}.x.npy", x.getvalue())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def _tar_row(sample: Mapping[str, Any]) -> dict[str, Any]:
    if int(sample["x.npy"][0]) != sample["id.cls"]:
        raise AssertionError(f"a sample's members are torn: {sample}")
    return {"id": sample["id.cls"]}


def _dataset(args: argparse.Namespace) -> Any:
    if args.dataset == "ids":
        return FiniteIds(args.ids, args.chunk)
    files = sorted(str(p) for p in Path(args.data).iterdir())
    if args.dataset == "tar":
        from gigashuffle.sources import Sharded, TarReader

        return Sharded(files, TarReader(transform=_tar_row), rows=args.chunk, pass_field="pass")
    # tests/integration/datasets.py would shadow Hugging Face's package (it is this script's directory), in this
    # process and in the loader's, which take this sys.path.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from datasets import load_dataset

    from gigashuffle.sources import Chunked

    source = load_dataset("parquet", data_files=files, split="train", streaming=True).with_format("torch")
    return Chunked(source, rows=args.chunk, fields=("id",), pass_field="pass")


def _record(batch: list[dict[str, torch.Tensor]]) -> list[tuple[int, int]]:
    group = batch[0]
    return list(zip(group["id"].tolist(), group["pass"].tolist(), strict=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--redis-url", required=True)
    p.add_argument("--queue", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", default="")
    p.add_argument("--save", default="")
    p.add_argument("--before", type=int, default=0)
    p.add_argument("--after", type=int, default=0)
    p.add_argument("--drain-past", type=int, default=0)
    p.add_argument("--counted", default="", help="a file of the ids of pass 0 counted by the earlier segments")
    p.add_argument("--kill-writer-at", type=int, default=-1)
    p.add_argument("--ids", type=int, default=2000)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--shuffle-size", type=int, default=256)
    p.add_argument("--max-seconds", type=float, default=240.0)
    p.add_argument("--dataset", choices=("ids", "hf", "tar"), default="ids")
    p.add_argument("--data", default="", help="the shards' directory for --dataset hf/tar (write_shards)")
    p.add_argument("--way", default="", help="DataloaderConfig.checkpoint_rows ('' leaves the default)")
    args = p.parse_args()
    way = {"checkpoint_rows": args.way} if args.way else {}
    cfg = DataloaderConfig(bs=args.bs, shuffle_size=args.shuffle_size, queue_name=args.queue, num_writers=2,
                           num_readers=2, redis_url=args.redis_url, max_restarts=3, **way)  # fmt: skip
    deadline = time.monotonic() + args.max_seconds
    loader = MultiprocessShuffledDataloader(_dataset(args), cfg)
    if args.resume:
        loader.load_state_dict(torch.load(args.resume, weights_only=False))
    it = iter(loader)
    with open(args.out + ".before", "w") as before:
        if args.before == 0:  # the last segment: every id of pass 0 not counted yet, then a margin for repeats
            counted = set(map(int, Path(args.counted).read_text().split())) if args.counted else set()
            missing = {w * STRIDE + i for w in range(2) for i in range(args.ids)} - counted
            margin = args.drain_past
            while (missing or margin > 0) and time.monotonic() < deadline:
                for i, ps in _record(next(it)):
                    before.write(f"{i} {ps}\n")
                    if ps == 0:
                        missing.discard(i)
                    margin -= not missing
            before.flush()
            loader.close()
            return
        for n in range(args.before):
            if n == args.kill_writer_at:
                os.kill(loader.child_pids()["writer"][0], signal.SIGKILL)
            for i, ps in _record(next(it)):
                before.write(f"{i} {ps}\n")
        before.flush()
        os.fsync(before.fileno())
    try:
        state = loader.state_dict()
    except KeyboardInterrupt:  # a Ctrl-C inside it (a fail point): take it again, as README says a script may,
        time.sleep(0.1)  # after some work of its own: the loader's readers draw again meanwhile
        state = loader.state_dict()
    torch.save(state, args.save + ".tmp")
    os.replace(args.save + ".tmp", args.save)
    with open(args.out + ".after", "w") as after:
        for _ in range(args.after):
            for i, ps in _record(next(it)):
                after.write(f"{i} {ps}\n")
    os.kill(os.getpid(), signal.SIGKILL)


class HeldIds(FiniteIds):
    """``FiniteIds`` whose writer, at its first chunk fetched once the file ``start`` exists, creates the file
    ``held`` and waits (holding that chunk, writing nothing and answering nothing) until the file ``end`` exists;
    if ``end`` does not come within ``hold_s`` it creates ``held + ".deadline"`` and goes on (a test that finds it
    knows its window was not held). tests/integration/test_checkpoint_mutations.py holds a rank's writer from the
    moment the node's other rank is in its cut until its own cut has asked it for its state."""

    def __init__(self, ids: int, chunk: int, start: str, end: str, held: str, hold_s: float = 60.0) -> None:
        super().__init__(ids, chunk)
        self.start, self.end, self.held, self.hold_s = start, end, held, hold_s
        self._done = False

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        for chunk in super().__iter__():
            if not self._done and os.path.exists(self.start):
                self._done = True
                Path(self.held).touch()
                deadline = time.monotonic() + self.hold_s
                while not os.path.exists(self.end):  # a wait on a file, with a deadline
                    if time.monotonic() > deadline:
                        Path(self.held + ".deadline").touch()
                        break
                    time.sleep(0.002)
            yield chunk


if __name__ == "__main__":
    main()
