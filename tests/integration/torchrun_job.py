"""The per-rank script of the torchrun integration tests (run by ``python -m torch.distributed.run``).

Every rank builds its ``DataloaderConfig`` from torchrun's environment (LOCAL_RANK, RANK, LOCAL_WORLD_SIZE,
WORLD_SIZE), reads ``--batches`` batches from the node's shared buffer, then gathers what every rank read on
rank 0, which checks the multi-rank invariants and writes a JSON result to ``--out``:

* no row id was read twice anywhere in the job (rows are evicted on read, and each node has its own buffer);
* no row is torn (``check`` and ``x`` are functions of ``id``, so a half-written or mixed row shows);
* every writer saw ``num_workers == WORLD_SIZE * num_writers`` in ``get_worker_info()``;
* a rank only ever read rows written by writers of its own node (node = global_rank // local_world_size);
* the ranks of a node share one buffer: their reads together cover every writer of the node.

Row ids are ``get_worker_info().id * 2**32 + counter``: unique in the whole job, and the writer (hence its rank
and node) is ``id >> 32``.

Options for the tests:

``--hold-dir D``: after reading, each rank writes ``D/ready-<rank>`` (with its view of the queue's keys) and
waits (bounded) for ``D/release`` before closing, so a test can inspect Redis and the runtime dir while every
loader is still open. ``--pid-dir D``: each rank writes ``D/rank-<rank>.json`` (its pid, and whether it started
the node's embedded server) once it has read its first batch.
``--batches 0``: read until killed (bounded by ``--max-seconds``), for the kill test.

The process exits 0 only when rank 0 found no violation; a rank that fails raises, which fails the torchrun job.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader

CHUNK_ROWS = 16
_MIX = 0x9E3779B97F4A7C15 & (2**63 - 1)


def check_of(ids: torch.Tensor) -> torch.Tensor:
    """A second field derived from the id: a torn row (id and check from different writes) does not match."""
    return (ids * 2654435761 + 12345) ^ _MIX


def x_of(ids: torch.Tensor) -> torch.Tensor:
    """A float field derived from the id (exactly representable: < 2**24)."""
    low = (ids % 100_003).to(torch.float32)
    return torch.stack([low, low + 1, low * 2, -low], dim=1)


class UniqueIds(IterableDataset):
    """Chunks of rows with globally unique ids; ``self.context`` may be set by attach_training_context."""

    context = None

    def __iter__(self):
        info = get_worker_info()
        if info is None:
            raise RuntimeError("UniqueIds must run in a gigashuffle writer (get_worker_info() is None)")
        base = info.id * 2**32
        counter = 0
        while True:
            ids = torch.arange(base + counter, base + counter + CHUNK_ROWS, dtype=torch.int64)
            counter += CHUNK_ROWS
            yield [
                {
                    "id": ids,
                    "check": check_of(ids),
                    "x": x_of(ids),
                    "num_workers": torch.full((CHUNK_ROWS,), info.num_workers, dtype=torch.int64),
                }
            ]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--queue", required=True)
    p.add_argument(
        "--redis-url",
        default=os.environ.get("GIGASHUFFLE_TEST_REDIS_URL") or None,
        help="omit (or pass 'embedded') for the embedded default",
    )
    p.add_argument("--out", required=True, help="JSON result path (written by rank 0)")
    p.add_argument("--batches", type=int, default=100, help="batches per rank; 0 reads until killed")
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--shuffle-size", type=int, default=256)
    p.add_argument("--num-writers", type=int, default=1)
    p.add_argument("--num-readers", type=int, default=1)
    p.add_argument("--hold-dir", default=None)
    p.add_argument("--pid-dir", default=None)
    p.add_argument("--max-seconds", type=float, default=180.0, help="deadline for reading and for --hold-dir")
    args = p.parse_args(argv)
    if args.redis_url in ("", "embedded", "none"):
        args.redis_url = None
    return args


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _queue_keys(loader: MultiprocessShuffledDataloader) -> list[str]:
    client = loader.redis_client()
    return sorted(k.decode() if isinstance(k, bytes) else k for k in client.scan_iter(match="gigashuffle:*"))


def _meta_owner(loader: MultiprocessShuffledDataloader) -> str:
    owner = loader.redis_client().hget(loader.keys.meta, "owner")
    return owner.decode() if isinstance(owner, bytes) else str(owner)


def _writers_seen(ids: list[torch.Tensor]) -> set[int]:
    return set((torch.cat(ids) >> 32).unique().tolist()) if ids else set()


def _check(gathered: list[dict], world: int, local_world: int, num_writers: int) -> list[str]:
    """Every invariant of the job, on rank 0; returns the violations (empty when all hold)."""
    errors: list[str] = []
    seen: dict[int, int] = {}
    writers_read_per_node: dict[int, set[int]] = {}
    for rank_result in gathered:
        rank, node = rank_result["rank"], rank_result["node_index"]
        ids = torch.tensor(rank_result["ids"], dtype=torch.int64)
        for i in rank_result["ids"]:
            if i in seen:
                errors.append(f"id {i} was read by rank {seen[i]} and again by rank {rank}")
                if len(errors) > 20:
                    return errors
            seen[i] = rank
        if rank_result["torn"]:
            errors.append(f"rank {rank} read {rank_result['torn']} torn rows, e.g. {rank_result['torn_example']}")
        if rank_result["num_workers"] != [world * num_writers]:
            errors.append(f"rank {rank} saw num_workers {rank_result['num_workers']}, expected {world * num_writers}")
        writer_ids = (ids >> 32).unique().tolist()
        foreign_nodes = {w // num_writers // local_world for w in writer_ids} - {node}
        if foreign_nodes:
            errors.append(f"rank {rank} (node {node}) read rows written on nodes {sorted(foreign_nodes)}")
        writers_read_per_node.setdefault(node, set()).update(writer_ids)
    for node, writers in sorted(writers_read_per_node.items()):
        first = node * local_world * num_writers
        expected = set(range(first, first + local_world * num_writers))
        if writers != expected:
            errors.append(
                f"node {node}: its ranks read rows of writers {sorted(writers)}, expected all of {sorted(expected)} "
                "(the node's ranks do not share one buffer)"
            )
    return errors


def main(argv: list[str]) -> int:
    args = _parse(argv)
    t_start = time.monotonic()
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = DataloaderConfig(
        bs=args.bs,
        shuffle_size=args.shuffle_size,
        queue_name=args.queue,
        num_writers=args.num_writers,
        num_readers=args.num_readers,
        local_rank=local_rank,
        global_rank=rank,
        local_world_size=local_world,
        global_world_size=world,
        redis_url=args.redis_url,
    )
    loader = MultiprocessShuffledDataloader(UniqueIds(), config)
    try:
        t_constructed = time.monotonic()
        deadline = t_start + args.max_seconds
        ids: list[torch.Tensor] = []
        torn, torn_example, num_workers = 0, None, set()
        batches = 0
        node_first = (rank // local_world) * local_world * args.num_writers
        node_writers = set(range(node_first, node_first + local_world * args.num_writers))
        for batch in loader:
            group = batch[0]
            bid, bcheck, bx = group["id"], group["check"], group["x"]
            bad = (bcheck != check_of(bid)) | (bx != x_of(bid)).any(dim=1)
            if bad.any():
                torn += int(bad.sum())
                torn_example = torn_example or [int(bid[bad][0]), int(bcheck[bad][0])]
            num_workers.update(group["num_workers"].tolist())
            ids.append(bid.clone())
            del batch, group, bid, bcheck, bx
            batches += 1
            if batches == 1 and args.pid_dir:
                started = loader._sup.link.server is not None and loader._sup.link.server.process is not None
                info = {"pid": os.getpid(), "rank": rank, "started_embedded_server": started}
                _atomic_write(Path(args.pid_dir) / f"rank-{rank}.json", json.dumps(info))
            if args.batches and batches >= args.batches and node_writers <= _writers_seen(ids):
                # Read on until rows of every writer of the node showed up: a writer whose rank started late
                # (a loaded machine) has then written into the shared buffer too, so the sharing check holds.
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} read {batches} batches and hit --max-seconds={args.max_seconds}")
        t_read = time.monotonic()
        stats = loader.stats()
        all_ids = torch.cat(ids)
        node_index = rank // local_world
        own_writers = set(
            range(node_index * local_world * args.num_writers, (node_index + 1) * local_world * args.num_writers)
        )
        my_writers = set(range(rank * args.num_writers, (rank + 1) * args.num_writers))
        writer_of_row = (all_ids >> 32).tolist()
        result = {
            "rank": rank,
            "local_rank": local_rank,
            "node": config.node,
            "node_index": node_index,
            "pid": os.getpid(),
            "redis_url": loader.redis_url,
            "key_tag": loader.keys.tag,
            "batches": batches,
            "rows": len(writer_of_row),
            "rows_from_other_ranks_of_node": sum(1 for w in writer_of_row if w in own_writers - my_writers),
            "ids": all_ids.tolist(),
            "torn": torn,
            "torn_example": torn_example,
            "num_workers": sorted(num_workers),
            "stats": {"full": stats.full, "empty": stats.empty, "in_flight": stats.in_flight},
            "construct_s": round(t_constructed - t_start, 3),
            "read_s": round(t_read - t_constructed, 3),
        }
        if args.hold_dir:
            hold = Path(args.hold_dir)
            ready = {
                "rank": rank,
                "node": config.node,
                "keys": _queue_keys(loader),
                "redis_url": loader.redis_url,
                "meta_owner": _meta_owner(loader),
            }
            _atomic_write(hold / f"ready-{rank}", json.dumps(ready))
            while not (hold / "release").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank}: {hold / 'release'} did not appear within --max-seconds")
                time.sleep(0.05)
        gathered: list[dict] | None = [None] * world if rank == 0 else None  # type: ignore[list-item]
        dist.gather_object(result, gathered, dst=0)
        dist.barrier()  # every rank has read and gathered: close together
    finally:
        loader.close()
    t_closed = time.monotonic()
    code = 0
    if rank == 0:
        assert gathered is not None
        errors = _check(gathered, world, local_world, args.num_writers)
        summary = {
            "ok": not errors,
            "errors": errors,
            "world_size": world,
            "local_world_size": local_world,
            "num_writers": args.num_writers,
            "unique_ids": len({i for r in gathered for i in r["ids"]}),
            "total_rows": sum(r["rows"] for r in gathered),
            "rank0_wall_s": round(t_closed - t_start, 3),
            "ranks": [{k: v for k, v in r.items() if k != "ids"} for r in gathered],
        }
        _atomic_write(Path(args.out), json.dumps(summary, indent=1))
        code = 0 if not errors else 3
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    # torchrun stops the other ranks with SIGTERM when one fails; turn it into an exception so that the
    # loader's close() (in the finally above) runs, as a training script's own handler would.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main(sys.argv[1:]))
