"""The per-rank script of the framework tests (``test_integrations.py``), run by ``torch.distributed.run``.

``--phase save``: train a tiny model on the loader through ``--framework`` (lightning, transformers, accelerate
or dcp), checkpoint at step ``SAVE_AT`` through the framework, then every rank writes ``--dir/save-<rank>.json``
(the rows its model trained on in steps 1..SAVE_AT) and SIGKILLs itself at the next step (after a barrier, so
the checkpoint is complete): a kill, not an exit. Rows delivered after the checkpoint (a framework that fetches
a batch ahead, the step the kill ends) are lost with the job and must come back after the resume.
``--phase resume``: a new job (of the same queue) resumes from that checkpoint through the framework and trains
until every id of pass 0 has been trained on, over both phases and both ranks, and at least ``RESUME_STEPS``
steps (``PassZero``; at most ``MAX_RESUME_STEPS``); each rank writes ``--dir/resume-<rank>.json``, every row its
model trained on. The end is a count, not a step number: the saved rows come back through one writer per rank,
racing the others for empty slots, and on a loaded machine that writer can be off the CPU for the few seconds 64
steps take, so a fixed step count lost rows that were only late (seen twice in fresh-clone runs).

The dataset is finite per pass: ``IDS`` unique ids per writer (``id = wid * STRIDE + i``, ``wid`` the writer's
job-wide id), then a new pass of the same ids. ``state_dict`` is its (pass, position) and ``wid``:
``load_state_dict`` checks that a writer gets its own state (another rank's part fails the job). Rows: ``x``
float[4], ``labels`` float, ``rid`` (the id), ``rpass`` (the pass).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader

SAVE_AT = 2
# Steps after the resume, at least: the rest of a rank's pass 0 (2 * IDS - SAVE_AT * BS = 32 rows, 4 steps) and then
# enough draws that no row of pass 0 is left in the buffer (a row written twice would show): a step of both ranks
# draws 2 * BS = 16 of the node's SHUFFLE = 64 slots, so a row stays undrawn for 56 steps with a chance of
# 0.75**56 = 1e-7. The phase goes on past it until every id of pass 0 was trained on (PassZero).
RESUME_STEPS = 64
MAX_RESUME_STEPS = 2000  # a lost row ends the phase here, and the test names it
NUM_WRITERS = 2
IDS = 24  # per writer and pass: 4 writers, 96 ids; a rank's 48 are 6 steps
STRIDE = 10**6
CHUNK = 4
BS = 8
SHUFFLE = 64  # the node's, shared by its two ranks


class FiniteIds(IterableDataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.passes, self.pos = 0, 0

    def state_dict(self) -> dict[str, int]:
        info = get_worker_info()
        return {"wid": info.id if info else -1, "pass": self.passes, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        info = get_worker_info()
        wid = info.id if info else -1
        if state["wid"] != wid:
            raise ValueError(f"writer {wid} was given the state of writer {state['wid']}")
        self.passes, self.pos = int(state["pass"]), int(state["pos"])

    def __iter__(self) -> Any:
        info = get_worker_info()
        wid = info.id if info else -1
        while self.pos < IDS:
            start, self.pos = self.pos, min(self.pos + CHUNK, IDS)
            ids = torch.arange(start, self.pos, dtype=torch.int64) + wid * STRIDE
            yield [{
                "x": ids.float().unsqueeze(1).repeat(1, 4) / 1e7,
                "labels": ids.float() / 1e7,
                "rid": ids,
                "rpass": torch.full_like(ids, self.passes),
            }]  # fmt: skip
        self.passes, self.pos = self.passes + 1, 0


class TinyModel(torch.nn.Module):
    """``model(**batch)`` as the HF Trainer calls it; records the (id, pass) of the rows of each step."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.steps: list[list[tuple[int, int]]] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor, rid: torch.Tensor, rpass: torch.Tensor) -> Any:
        self.steps.append(list(zip(rid.tolist(), rpass.tolist(), strict=True)))
        loss = torch.nn.functional.mse_loss(self.linear(x).squeeze(1), labels)
        return {"loss": loss}


def make_loader(args: argparse.Namespace) -> MultiprocessShuffledDataloader:
    # Both ranks on one node, sharing its buffer: their checkpoint is one cut of the node (NOTE [ Node cut ]).
    config = DataloaderConfig.from_env(
        bs=BS, shuffle_size=SHUFFLE, min_mixing=0.25, num_writers=NUM_WRITERS, num_readers=1, queue_name=args.queue,
        redis_url=args.redis_url, batch_format="dict", index_key=False, max_restarts=0,
    )  # fmt: skip
    return MultiprocessShuffledDataloader(FiniteIds(), config)


def kill_after_barrier(args: argparse.Namespace, model: TinyModel) -> None:
    """The rows trained on up to the checkpoint (steps 1..SAVE_AT) go to a file; then every rank dies."""
    write_rows(args, "save", model.steps[:SAVE_AT])
    if dist.is_initialized():
        dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


class PassZero:
    """Whether the resumed phase may end: every id of pass 0 trained on (in the save phase, read from its files, or
    since the resume, on any rank: an ``all_reduce``, so every rank ends at the same step) and at least
    ``RESUME_STEPS`` steps done; or ``MAX_RESUME_STEPS``."""

    def __init__(self, args: argparse.Namespace, model: TinyModel) -> None:
        self.model = model
        self.ids = [w * STRIDE + i for w in range(int(os.environ["WORLD_SIZE"]) * NUM_WRITERS) for i in range(IDS)]
        self.slot = {rid: n for n, rid in enumerate(self.ids)}
        self.seen = torch.zeros(len(self.ids), dtype=torch.int64)
        for rank in range(int(os.environ["WORLD_SIZE"])):
            saved = json.loads((Path(args.dir) / f"save-{rank}.json").read_text())["rows"]
            self._count([(int(i), int(p)) for i, p in saved])
        self.counted = 0  # of model.steps

    def _count(self, rows: list[tuple[int, int]]) -> None:
        for rid, rpass in rows:
            if rpass == 0 and rid in self.slot:
                self.seen[self.slot[rid]] = 1

    def done(self, steps: int) -> bool:
        for step in self.model.steps[self.counted :]:
            self._count(step)
        self.counted = len(self.model.steps)
        seen = self.seen.clone()
        if dist.is_initialized():
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        return steps >= MAX_RESUME_STEPS or (steps >= RESUME_STEPS and bool(seen.all()))


def write_rows(args: argparse.Namespace, phase: str, steps: list[list[tuple[int, int]]]) -> None:
    rank = int(os.environ["RANK"])
    path = Path(args.dir) / f"{phase}-{rank}.json"
    path.write_text(json.dumps({"rank": rank, "steps": len(steps), "rows": [row for step in steps for row in step]}))


# -- Lightning ---------------------------------------------------------------------------------------------------


def run_lightning(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl

    from gigashuffle.integrations.lightning import GigashuffleCallback, GigashuffleDataModule

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyModel()

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(**batch)["loss"]
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Kill(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            if args.phase == "save" and trainer.global_step == SAVE_AT + 1:
                kill_after_barrier(args, module.model)
            if args.phase == "resume" and pass_zero.done(trainer.global_step - SAVE_AT):
                trainer.should_stop = True

    ckpt_dir = Path(args.dir) / "ckpt"
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVE_AT, save_top_k=-1)
    resume = args.phase == "resume"
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp", max_steps=SAVE_AT + MAX_RESUME_STEPS
        if resume else 1000, callbacks=[checkpoint, Kill(), GigashuffleCallback(log_every_n_steps=2)],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = Module()
    pass_zero = PassZero(args, module.model) if resume else None
    ckpt = str(ckpt_dir / f"epoch=0-step={SAVE_AT}.ckpt") if resume else None
    trainer.fit(module, datamodule=GigashuffleDataModule(lambda: make_loader(args)), ckpt_path=ckpt)
    write_rows(args, "resume", module.model.steps)


# -- Hugging Face Trainer ----------------------------------------------------------------------------------------


def run_transformers(args: argparse.Namespace) -> None:
    from transformers import TrainerCallback, TrainingArguments

    from gigashuffle.integrations.transformers import STATE_FILE, GigashuffleTrainer

    class Kill(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, _args: Any, state: Any, control: Any, **_: Any) -> None:
            if args.phase == "save" and state.global_step == SAVE_AT + 1:
                kill_after_barrier(args, model)
            if args.phase == "resume" and pass_zero.done(state.global_step - SAVE_AT):
                control.should_training_stop = True

    resume = args.phase == "resume"
    training = TrainingArguments(
        output_dir=str(Path(args.dir) / "out"), max_steps=SAVE_AT + MAX_RESUME_STEPS if resume else 1000,
        save_steps=SAVE_AT, save_strategy="steps", per_device_train_batch_size=8, ignore_data_skip=True,
        report_to=[], use_cpu=True, ddp_backend="gloo", logging_steps=2, disable_tqdm=True,
    )  # fmt: skip
    loader = make_loader(args)
    model = TinyModel()
    pass_zero = PassZero(args, model) if resume else None
    trainer = GigashuffleTrainer(model=model, args=training, loader=loader, callbacks=[Kill()])
    ckpt = str(Path(args.dir) / "out" / f"checkpoint-{SAVE_AT}") if resume else None
    trainer.train(resume_from_checkpoint=ckpt)
    assert ckpt is None or (Path(ckpt) / STATE_FILE).exists(), "the loader's state is in the Trainer's checkpoint"
    write_rows(args, "resume", model.steps)
    loader.close()


# -- accelerate and torch.distributed.checkpoint -----------------------------------------------------------------


def run_accelerate(args: argparse.Namespace) -> None:
    from accelerate import Accelerator

    from gigashuffle.integrations.accelerate import register

    accelerator = Accelerator(cpu=True)
    loader = make_loader(args)
    model = TinyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp, optimizer = accelerator.prepare(model, optimizer)
    pass_zero = PassZero(args, model) if args.phase == "resume" else None
    register(accelerator, loader)
    state_dir = Path(args.dir) / "state"
    if args.phase == "resume":
        accelerator.load_state(str(state_dir))
    for step, batch in enumerate(loader, start=1):
        loss = ddp(**batch)["loss"]
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if args.phase == "save" and step == SAVE_AT:
            accelerator.save_state(str(state_dir))
        if args.phase == "save" and step == SAVE_AT + 1:
            kill_after_barrier(args, model)
        if pass_zero is not None and pass_zero.done(step):
            break
    write_rows(args, "resume", model.steps)
    loader.close()


def run_dcp(args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint as dcp

    from gigashuffle.integrations.state import RankKeyedState

    dist.init_process_group("gloo")
    loader = make_loader(args)
    model = TinyModel()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    pass_zero = PassZero(args, model) if args.phase == "resume" else None
    state_dir = str(Path(args.dir) / "dcp")
    if args.phase == "resume":
        dcp.load({"model": model.state_dict(), "loader": RankKeyedState(loader)}, checkpoint_id=state_dir)
    for step, batch in enumerate(loader, start=1):
        loss = ddp(**batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if args.phase == "save" and step == SAVE_AT:
            dcp.save({"model": model.state_dict(), "loader": RankKeyedState(loader)}, checkpoint_id=state_dir)
        if args.phase == "save" and step == SAVE_AT + 1:
            kill_after_barrier(args, model)
        if pass_zero is not None and pass_zero.done(step):
            break
    write_rows(args, "resume", model.steps)
    loader.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["lightning", "transformers", "accelerate", "dcp"], required=True)
    parser.add_argument("--phase", choices=["save", "resume"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--redis-url", required=True)
    args = parser.parse_args()
    {"lightning": run_lightning, "transformers": run_transformers, "accelerate": run_accelerate,
     "dcp": run_dcp}[args.framework](args)  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
