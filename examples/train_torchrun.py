"""Train a small MLP with DDP on data served by a gigashuffle buffer shared by every rank of the node.

    torchrun --standalone --nproc-per-node=2 examples/train_torchrun.py --steps 200

The data is a synthetic classification problem the script makes itself: ``--classes`` Gaussian blobs in
``--dim`` dimensions. The class centres are fixed (seed 0) and shared by everyone; each writer process draws its
own samples, deterministically from its ``get_worker_info().id``, the epoch it was told about and a chunk counter.
A held-out set drawn from another seed measures what the model learned.

What it shows:

* one ``DataloaderConfig`` per rank from torchrun's environment: all ranks of a node share one buffer;
* ``loader.get_dummy_batch()`` for a warm-up step (it builds DDP's buckets) before the buffer is mixed;
* ``loader.attach_training_context({"epoch": e})`` at each epoch: the dataset reads ``self.context``, and every
  row carries the epoch it was made in, so the log shows the buffer turning over to the new epoch;
* ``loader.stats()`` every ``--log-every`` steps;
* a checkpoint per rank at the end: model, optimizer and ``loader.state_dict()`` (each writer's chunk counter);
  ``--resume`` restores all three.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader

CHUNK_ROWS = 256
NOISE = 1.5  # the nearest-centre (Bayes) classifier gets about 81% right


def class_centres(classes: int, dim: int) -> torch.Tensor:
    """The problem itself: one centre per class, the same in every process."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(classes, dim, generator=g) * 1.1


def draw(centres: torch.Tensor, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(len(centres), (rows,), generator=g)
    x = centres[y] + NOISE * torch.randn(rows, centres.shape[1], generator=g)
    return x, y


class Blobs(IterableDataset):
    """Endless chunks of (x, y) samples; its state is the writer's chunk counter."""

    def __init__(self, classes: int, dim: int) -> None:
        self.classes, self.dim = classes, dim
        self.chunks = 0  # chunks made by this writer so far (state_dict / load_state_dict)
        self.context: dict[str, Any] | None = None  # set by loader.attach_training_context

    def __iter__(self):
        info = get_worker_info()  # this writer among all writers of the job
        centres = class_centres(self.classes, self.dim)
        while True:
            epoch = (self.context or {}).get("epoch", 0)
            seed = (info.id * 1_000_003 + epoch) * 1_000_003 + self.chunks
            x, y = draw(centres, CHUNK_ROWS, seed)
            self.chunks += 1
            yield [{"x": x, "y": y, "epoch": torch.full((CHUNK_ROWS,), epoch, dtype=torch.int64)}]

    def state_dict(self) -> dict[str, int]:
        return {"chunks": self.chunks}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.chunks = state["chunks"]


def mlp(dim: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, classes))


def evaluate(model: nn.Module, classes: int, dim: int) -> tuple[float, float]:
    """Loss and accuracy on a held-out set (its own seed: no writer ever draws these samples)."""
    x, y = draw(class_centres(classes, dim), 4096, seed=2**62)
    with torch.no_grad():
        logits = model(x)
    return nn.functional.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--steps-per-epoch", type=int, default=50)
    p.add_argument("--bs", type=int, default=64, help="batch size per rank")
    p.add_argument("--shuffle-size", type=int, default=4096, help="rows in the node's buffer")
    p.add_argument("--classes", type=int, default=12)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--queue", default="train-torchrun-example")
    p.add_argument("--redis-url", default=None, help="default: the embedded per-node server")
    p.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "gigashuffle-example-checkpoints"))
    p.add_argument("--resume", action="store_true", help="restore from --checkpoint-dir")
    return p.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    # The rank fields come from torchrun's LOCAL_RANK, RANK, LOCAL_WORLD_SIZE and WORLD_SIZE.
    config = DataloaderConfig.from_env(
        bs=args.bs,
        shuffle_size=args.shuffle_size,
        queue_name=args.queue,
        num_writers=1,
        num_readers=1,
        redis_url=args.redis_url,
    )
    torch.manual_seed(1234)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = DDP(mlp(args.dim, args.classes))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    checkpoint = Path(args.checkpoint_dir) / f"rank{rank}.pt"
    loss0, accuracy0 = evaluate(model.module, args.classes, args.dim)
    say(f"held-out before training: loss {loss0:.3f}, accuracy {accuracy0:.1%} (chance {1 / args.classes:.1%})")
    t0 = time.monotonic()
    with MultiprocessShuffledDataloader(Blobs(args.classes, args.dim), config) as loader:
        if config.local_rank == 0:  # one line per node
            print(
                f"node {config.node}: ranks {rank}..{rank + config.local_world_size - 1} of {world} share the buffer "
                f"of queue {args.queue!r}, Redis {loader.redis_url}"
            )
        first_step = 0
        if args.resume:
            state = torch.load(checkpoint, weights_only=False)
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            loader.load_state_dict(state["loader"])
            first_step = state["step"]
            say(f"resumed at step {first_step} from {checkpoint}")
        # Tell the writers the epoch before their first rows (a stateful dataset's writers hold until the first
        # batch or load_state_dict: NOTE [ Restore before reading ]).
        loader.attach_training_context({"epoch": first_step // args.steps_per_epoch})

        # Warm-up on a dummy batch (copies of the first row; nothing is consumed from the buffer): DDP builds its
        # buckets and the allocator warms up while the writers are still filling the buffer past min_mixing.
        dummy = loader.get_dummy_batch()[0]
        loss_fn(model(dummy["x"]), dummy["y"]).backward()
        optimizer.zero_grad(set_to_none=True)
        say(f"warm-up step on a dummy batch done at {time.monotonic() - t0:.1f}s; stats {loader.stats()}")

        it = iter(loader)
        running, seen = torch.zeros(2), 0
        for step in range(first_step, first_step + args.steps):
            epoch = step // args.steps_per_epoch
            if step % args.steps_per_epoch == 0 and step > first_step:
                loader.attach_training_context({"epoch": epoch})
            batch = next(it)[0]
            x, y = batch["x"], batch["y"]
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += torch.tensor([loss.item(), (batch["epoch"] == epoch).float().mean().item()])
            seen += 1
            del batch, x, y  # hand the batch's ring slot back to the reader
            if (step + 1) % args.log_every == 0:
                dist.all_reduce(running)
                mean_loss, fresh = (running / (seen * world)).tolist()
                say(
                    f"step {step + 1:4d}  epoch {epoch}  loss {mean_loss:.3f}  rows from this epoch {fresh:4.0%}  "
                    f"buffer {loader.stats()}  {time.monotonic() - t0:.1f}s"
                )
                running, seen = torch.zeros(2), 0

        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "loader": loader.state_dict(),
            "step": first_step + args.steps,
        }
        torch.save(state, checkpoint)
        part = state["loader"][f"rank{rank}"]
        say(
            f"checkpoint {checkpoint} (one per rank); loader state of rank {rank}: writers {part['writers']}, "
            f"skip {part['skip']}, {len(part['rows']['fields'][0]) if part['rows'] else 0} unconsumed rows saved"
        )
        dist.barrier()  # every rank is done with its loader: close together

    held_out_loss, accuracy = evaluate(model.module, args.classes, args.dim)
    say(
        f"held-out after {first_step + args.steps} steps: loss {held_out_loss:.3f}, accuracy {accuracy:.1%} "
        f"(nearest-centre classifier: about 81%); {time.monotonic() - t0:.1f}s"
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # torchrun stops the surviving ranks with SIGTERM when one fails: exit through the `with` so the loader closes.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    main()
