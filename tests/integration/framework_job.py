"""The per-rank script of the framework tests (``test_integrations.py``), run by ``torch.distributed.run``.

``--phase save``: train a tiny model on the loader through ``--framework`` (lightning, transformers, accelerate
or dcp), checkpoint at step ``SAVE_AT`` through the framework, then every rank SIGKILLs itself at the next step
(after a barrier, so the checkpoint is complete): a kill, not an exit.
``--phase resume``: a new job (another queue) resumes from that checkpoint through the framework and trains
``RESUME_STEPS`` more steps; each rank writes ``--dir/result-<rank>.json`` with, per writer whose rows it saw,
the dataset position the writer was restored to (``resumed``; -1 for rows written before the restore) and, where
the framework's file can be read here, the positions the checkpoint holds for every writer of the job. The ranks
of a node share its buffer, so a rank sees rows of every writer of the node.

The dataset checks in ``load_state_dict`` that a writer gets its own state (``wid``): another rank's part fails
the job. Rows: ``x`` float[4], ``labels`` float, ``wid`` (the writer's job-wide id), ``resumed``.
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

SAVE_AT = 4
RESUME_STEPS = 48  # enough that every writer's rows after its restore come, after the saved rows it puts back
NUM_WRITERS = 2


class Tagged(IterableDataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.pos = 0
        self.resumed = -1

    def state_dict(self) -> dict[str, int]:
        info = get_worker_info()
        return {"wid": info.id if info else -1, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        info = get_worker_info()
        wid = info.id if info else -1
        if state["wid"] != wid:
            raise ValueError(f"writer {wid} was given the state of writer {state['wid']}")
        self.pos = self.resumed = int(state["pos"])

    def __iter__(self) -> Any:
        info = get_worker_info()
        wid = info.id if info else -1
        while True:
            ids = torch.arange(self.pos, self.pos + 4, dtype=torch.float32)
            self.pos += 4
            yield [{
                "x": ids.unsqueeze(1).repeat(1, 4) / 1000,
                "labels": ids / 1000,
                "wid": torch.full((4,), wid, dtype=torch.int64),
                "resumed": torch.full((4,), self.resumed, dtype=torch.int64),
            }]  # fmt: skip


class TinyModel(torch.nn.Module):
    """``model(**batch)`` as the HF Trainer calls it; records the (wid, resumed) tags of the rows it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.seen: set[tuple[int, int]] = set()

    def forward(self, x: torch.Tensor, labels: torch.Tensor, wid: torch.Tensor, resumed: torch.Tensor) -> Any:
        self.seen.update(zip(wid.tolist(), resumed.tolist(), strict=True))
        loss = torch.nn.functional.mse_loss(self.linear(x).squeeze(1), labels)
        return {"loss": loss}


def make_loader(args: argparse.Namespace) -> MultiprocessShuffledDataloader:
    config = DataloaderConfig.from_env(
        bs=8, shuffle_size=64, min_mixing=0.25, num_writers=NUM_WRITERS, num_readers=1, queue_name=args.queue,
        redis_url=args.redis_url, batch_format="dict", index_key=False, max_restarts=0,
    )  # fmt: skip
    return MultiprocessShuffledDataloader(Tagged(), config)


def kill_after_barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def write_result(args: argparse.Namespace, seen: set[tuple[int, int]], saved: dict[str, Any] | None) -> None:
    rank = int(os.environ["RANK"])
    resumed: dict[int, list[int]] = {}
    for wid, value in seen:
        resumed.setdefault(wid, []).append(value)
    positions = None
    if saved is not None:  # every rank's part: the framework's file holds the gathered states
        positions = {str(w["wid"]): w["pos"] for part in saved.values() for w in part["writers"]}
    result = {"rank": rank, "resumed": {str(k): sorted(v) for k, v in resumed.items()}, "saved": positions}
    (Path(args.dir) / f"result-{rank}.json").write_text(json.dumps(result))


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
                kill_after_barrier()

    ckpt_dir = Path(args.dir) / "ckpt"
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVE_AT, save_top_k=-1)
    resume = args.phase == "resume"
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp", max_steps=SAVE_AT + RESUME_STEPS
        if resume else 1000, callbacks=[checkpoint, Kill(), GigashuffleCallback(log_every_n_steps=2)],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = Module()
    ckpt = str(ckpt_dir / f"epoch=0-step={SAVE_AT}.ckpt") if resume else None
    trainer.fit(module, datamodule=GigashuffleDataModule(lambda: make_loader(args)), ckpt_path=ckpt)
    saved = None
    if ckpt:
        state = torch.load(ckpt, weights_only=False)
        saved = state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    write_result(args, module.model.seen, saved)


# -- Hugging Face Trainer ----------------------------------------------------------------------------------------


def run_transformers(args: argparse.Namespace) -> None:
    from transformers import TrainerCallback, TrainingArguments

    from gigashuffle.integrations.transformers import STATE_FILE, GigashuffleTrainer

    class Kill(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, _args: Any, state: Any, control: Any, **_: Any) -> None:
            if args.phase == "save" and state.global_step == SAVE_AT + 1:
                kill_after_barrier()

    resume = args.phase == "resume"
    training = TrainingArguments(
        output_dir=str(Path(args.dir) / "out"), max_steps=SAVE_AT + RESUME_STEPS if resume else 1000,
        save_steps=SAVE_AT, save_strategy="steps", per_device_train_batch_size=8, ignore_data_skip=True,
        report_to=[], use_cpu=True, ddp_backend="gloo", logging_steps=2, disable_tqdm=True,
    )  # fmt: skip
    loader = make_loader(args)
    model = TinyModel()
    trainer = GigashuffleTrainer(model=model, args=training, loader=loader, callbacks=[Kill()])
    ckpt = str(Path(args.dir) / "out" / f"checkpoint-{SAVE_AT}") if resume else None
    trainer.train(resume_from_checkpoint=ckpt)
    saved = torch.load(Path(ckpt) / STATE_FILE, weights_only=False) if ckpt else None
    write_result(args, model.seen, saved)
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
    register(accelerator, loader)
    state_dir = Path(args.dir) / "state"
    saved = None
    if args.phase == "resume":
        accelerator.load_state(str(state_dir))
        saved = torch.load(state_dir / "custom_checkpoint_0.pkl", weights_only=False)
    for step, batch in enumerate(loader, start=1):
        loss = ddp(**batch)["loss"]
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if args.phase == "save" and step == SAVE_AT:
            accelerator.save_state(str(state_dir))
        if args.phase == "save" and step == SAVE_AT + 1:
            kill_after_barrier()
        if args.phase == "resume" and step == RESUME_STEPS:
            break
    write_result(args, model.seen, saved)
    loader.close()


def run_dcp(args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint as dcp

    from gigashuffle.integrations.state import RankKeyedState

    dist.init_process_group("gloo")
    loader = make_loader(args)
    model = TinyModel()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
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
            kill_after_barrier()
        if args.phase == "resume" and step == RESUME_STEPS:
            break
    write_result(args, model.seen, None)
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
