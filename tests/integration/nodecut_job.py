"""One rank of one segment of the multi-rank exact-checkpoint scenario (tests/integration/test_checkpoint_nodecut.py).

The dataset is checkpoint_job.py's ``FiniteIds`` (ids unique across the job's writers). Every rank of the job is
its own process; they meet in a gloo group (``--dist``, a ``tcp://`` address) only to merge the checkpoint
(``gathered_state_dict()``, saved by rank 0) and, in the last segment, to agree on when every id came.

A segment builds the loader, loads ``--resume`` right after construction, reads ``--before`` batches writing each row's
id and pass to ``<out>.rank<r>.before``, takes ``loader.gathered_state_dict()`` (every rank at the same step) into
``--save``, reads ``--after`` more batches (not counted) and SIGKILLs itself. ``--kill-reader-at N`` SIGKILLs this
rank's reader 0 after N batches; ``--late-s S`` calls ``state_dict()`` S seconds after the other ranks (a slower step),
its writers and readers running meanwhile. With ``--read-until F`` it instead reads on (and counts) batches until
the file ``F`` exists (local rank 0 creates it in its cut: a fail point's marker), then S seconds more, and removes
``F``.
``--after-cut-entry N`` (with ``--cut-started F``): after ``--before``, read nothing until local rank 0 is in its cut
(the file ``F``) and at one of its node barriers, then read N batches; ``--hold-writer START:END:HELD`` gives this
rank's writers checkpoint_job.py's ``HeldIds`` (tests/integration/test_checkpoint_mutations.py).
``--before 0 --counted F --drain-past P``: the last segment, reading until every id of pass 0 not in ``F`` came to
some rank, then ``P`` rows more across the job; everything it reads counts.

It only uses the public API (``--after-cut-entry`` also spells a Redis key with control/keys.py), so the same file
measures the code of another checkout (``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from checkpoint_job import STRIDE, FiniteIds, HeldIds, _record

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name in ("--redis-url", "--queue", "--out", "--dist"):
        p.add_argument(name, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--local-world", type=int, required=True)
    p.add_argument("--resume", default="")
    p.add_argument("--save", default="")
    p.add_argument("--before", type=int, default=0)
    p.add_argument("--after", type=int, default=0)
    p.add_argument("--drain-past", type=int, default=0)
    p.add_argument("--counted", default="")
    p.add_argument("--kill-reader-at", type=int, default=-1)
    p.add_argument("--late-s", type=float, default=0.0, help="a slow step: call state_dict() this much later")
    p.add_argument("--read-until", default="", help="read (and count) batches until this file exists, then --late-s")
    p.add_argument("--ids", type=int, default=500)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--shuffle-size", type=int, default=128)
    p.add_argument("--max-seconds", type=float, default=200.0)
    p.add_argument("--way", default="saved", help="DataloaderConfig.checkpoint_rows")
    p.add_argument("--hold-writer", default="", help="START:END:HELD, this rank's writers' HeldIds files")
    p.add_argument("--cut-started", default="", help="with --after-cut-entry: the file local rank 0 makes in its cut")
    p.add_argument("--after-cut-entry", type=int, default=-1, help="batches read once local rank 0 is at a barrier")
    p.add_argument("--saw-cut-entry", default="", help="the file made once local rank 0 was seen at a barrier")
    p.add_argument("--min-mixing", type=float, default=-1.0, help="DataloaderConfig.min_mixing (-1: the default)")
    p.add_argument("--ring-depth", type=int, default=0, help="DataloaderConfig.ring_depth (0: the default)")
    return p.parse_args()


def _drain(it: object, args: argparse.Namespace, out: object) -> None:
    """The last segment: read until every id of pass 0 not counted yet came to some rank, then a margin."""
    counted = set(map(int, Path(args.counted).read_text().split())) if args.counted else set()
    missing = {w * STRIDE + i for w in range(args.world) for i in range(args.ids)} - counted
    margin, deadline = args.drain_past, time.monotonic() + args.max_seconds
    while True:
        rows = _record(next(it))  # type: ignore[call-overload]
        for i, ps in rows:
            out.write(f"{i} {ps}\n")  # type: ignore[attr-defined]
        parts: list[object] = [None] * args.world
        dist.all_gather_object(parts, ([i for i, ps in rows if ps == 0], len(rows), time.monotonic() > deadline))
        ended = False
        for ids, n, late in parts:  # type: ignore[misc]
            missing.difference_update(ids)
            margin -= 0 if missing else n
            ended = ended or late
        if ended or (not missing and margin <= 0):
            return


def main() -> None:
    args = _args()
    dist.init_process_group("gloo", init_method=args.dist, rank=args.rank, world_size=args.world)
    cfg = DataloaderConfig(bs=args.bs, shuffle_size=args.shuffle_size, queue_name=args.queue, num_writers=1,
                           num_readers=1, redis_url=args.redis_url, max_restarts=3, global_rank=args.rank,
                           global_world_size=args.world, local_rank=args.rank % args.local_world,
                           local_world_size=args.local_world, checkpoint_rows=args.way,
                           **({"min_mixing": args.min_mixing} if args.min_mixing >= 0 else {}),
                           **({"ring_depth": args.ring_depth} if args.ring_depth else {}))  # fmt: skip
    held = args.hold_writer.split(":") if args.hold_writer else []
    dataset = HeldIds(args.ids, args.chunk, *held) if held else FiniteIds(args.ids, args.chunk)
    loader = MultiprocessShuffledDataloader(dataset, cfg)
    if args.resume:
        loader.load_state_dict(torch.load(args.resume, weights_only=False))
    it = iter(loader)
    with open(f"{args.out}.rank{args.rank}.before", "w") as before:
        if args.before == 0:
            _drain(it, args, before)
            before.flush()
            loader.close()
            dist.destroy_process_group()
            return
        for n in range(args.before):
            if n == args.kill_reader_at:
                os.kill(loader.child_pids()["reader"][0], signal.SIGKILL)
            for i, ps in _record(next(it)):
                before.write(f"{i} {ps}\n")
        if args.read_until:  # this rank's readers draw while local rank 0 is in its cut
            marker, late_until = Path(args.read_until), time.monotonic() + args.max_seconds
            while time.monotonic() < late_until:
                if marker.exists() and late_until > time.monotonic() + args.late_s:
                    late_until = time.monotonic() + args.late_s
                for i, ps in _record(next(it)):
                    before.write(f"{i} {ps}\n")
            marker.unlink(missing_ok=True)
        if args.after_cut_entry >= 0:
            _read_past_cut_entry(it, args, before)
        before.flush()
        os.fsync(before.fileno())
    if not args.read_until:
        time.sleep(args.late_s)  # a step slower than the other ranks': the node's other ranks wait at the barrier
    state = loader.gathered_state_dict()
    if args.rank == 0:
        torch.save(state, args.save + ".tmp")
        os.replace(args.save + ".tmp", args.save)
    dist.barrier()  # nobody dies before the checkpoint is written
    with open(f"{args.out}.rank{args.rank}.after", "w") as after:
        for _ in range(args.after):
            for i, ps in _record(next(it)):
                after.write(f"{i} {ps}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def _read_past_cut_entry(it: object, args: argparse.Namespace, out: object) -> None:
    """``--after-cut-entry N``: read nothing until local rank 0 is in its first checkpoint's cut (``--cut-started``
    exists) and has arrived at a node barrier of it (its entry ``1 <phase> <token>`` in the node's cut hash: NOTE
    [ Node cut ] in control/cutbarrier.py), so it has paused its own writers and readers and passed every step it
    takes before that barrier; then read (and count) N batches, whose rows this rank's readers draw from then on."""
    import redis

    from gigashuffle.control.keys import QueueKeys

    client = redis.Redis.from_url(args.redis_url, decode_responses=True)
    keys = QueueKeys(args.queue, f"n{args.rank // args.local_world}")
    started, deadline = Path(args.cut_started), time.monotonic() + args.max_seconds

    def arrived() -> bool:
        generation = client.get(keys.gen)
        entry = client.hget(keys.cut(str(generation)), "0") if generation else None
        return str(entry or "").split(" ")[0] == "1"

    while not (started.exists() and arrived()):  # a wait on a file and a Redis entry, with a deadline
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {args.rank}: local rank 0 never arrived at a barrier of its first checkpoint")
        time.sleep(0.002)
    client.close()
    Path(args.saw_cut_entry).touch()
    for _ in range(args.after_cut_entry):
        for i, ps in _record(next(it)):  # type: ignore[call-overload]
            out.write(f"{i} {ps}\n")  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
