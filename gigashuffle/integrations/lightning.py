"""PyTorch Lightning: a ``LightningDataModule`` whose loader state goes into Lightning's checkpoints, restored on
every rank, and a callback that hands the epoch to the writers and logs ``loader.metrics()``.

Lightning's fit loop saves the state of every train loader that has ``state_dict``/``load_state_dict`` (into the
checkpoint's ``loops`` entry), asking every rank and writing rank 0's; ``train_dataloader()`` hands it a
``StatefulLoader``, whose state is every rank's, gathered (NOTE [ Rank-keyed state ] in integrations/state.py).
Install with ``pip install gigashuffle[lightning]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from gigashuffle import MultiprocessShuffledDataloader
from gigashuffle.integrations.state import StatefulLoader

LoaderOrFactory = MultiprocessShuffledDataloader | Callable[[], MultiprocessShuffledDataloader]


class GigashuffleDataModule(pl.LightningDataModule):  # type: ignore[misc,unused-ignore]
    """Serves ``loader`` (or the loader ``make_loader()`` builds, on first use in each rank) as the train loader,
    and closes it at teardown. It warns when the Trainer's checkpoints come only at an epoch's end, which an
    endless loader never reaches (``no_checkpoint_before_the_end``)."""

    def __init__(self, loader: LoaderOrFactory) -> None:
        super().__init__()
        if not isinstance(loader, MultiprocessShuffledDataloader) and not callable(loader):
            raise TypeError(
                f"GigashuffleDataModule(loader={loader!r}) needs a MultiprocessShuffledDataloader or a function that "
                "builds one"
            )
        self._source = loader
        self._loader: StatefulLoader | None = None

    @property
    def loader(self) -> MultiprocessShuffledDataloader:
        if self._loader is None:
            built = self._source if isinstance(self._source, MultiprocessShuffledDataloader) else self._source()
            self._loader = StatefulLoader(built, trained=self._trained)
        return self._loader.loader

    def _trained(self) -> int:
        """Batches the fit loop has taken into training steps this epoch: it fetches one ahead (NOTE [ Rank-keyed
        state ] in integrations/state.py)."""
        trainer = self.trainer
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready) if trainer is not None else 0

    def train_dataloader(self) -> StatefulLoader:
        self.loader  # noqa: B018 (builds it)
        if self._loader is None:
            raise AssertionError("the loader was not built")
        if self.trainer is not None and no_checkpoint_before_the_end(self.trainer, self._loader.loader):
            rank_zero_warn(
                "GigashuffleDataModule: the loader has no end (DataloaderConfig.steps_per_epoch=None), so the "
                "epoch's end never comes, and no ModelCheckpoint of this Trainer saves before it: nothing is "
                'checkpointed before max_steps, and fit(ckpt_path="last") after a crash starts again from step 0; '
                "add ModelCheckpoint(every_n_train_steps=N, save_last=True) to the Trainer's callbacks"
            )
        return self._loader

    def teardown(self, stage: str) -> None:
        if self._loader is not None and stage == "fit":
            self._loader.loader.close()


def no_checkpoint_before_the_end(trainer: pl.Trainer, loader: MultiprocessShuffledDataloader) -> bool:
    """Whether ``trainer`` checkpoints (it has a ``ModelCheckpoint``), but only at epoch ends, which an endless
    ``loader`` never reaches: Lightning's default checkpoint is such a one."""
    if loader.config.steps_per_epoch is not None or loader.config.fill_once:
        return False
    checkpoints = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    periodic = [
        cb
        for cb in checkpoints
        if getattr(cb, "_every_n_train_steps", 0) >= 1 or getattr(cb, "_train_time_interval", None) is not None
    ]
    return bool(checkpoints) and not periodic


class GigashuffleCallback(pl.Callback):  # type: ignore[misc,unused-ignore]
    """Each train epoch: ``loader.set_epoch(epoch)``; every ``log_every_n_steps`` steps: the loader's metrics
    through ``pl_module.log_dict`` (prefix ``gigashuffle/``), on each rank's own logger."""

    def __init__(self, log_every_n_steps: int = 50) -> None:
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"GigashuffleCallback(log_every_n_steps={log_every_n_steps!r}) needs an int >= 1")
        self.every = log_every_n_steps

    @staticmethod
    def _loader(trainer: pl.Trainer) -> MultiprocessShuffledDataloader | None:
        loader = getattr(trainer, "train_dataloader", None)
        return loader.loader if isinstance(loader, StatefulLoader) else None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = self._loader(trainer)
        if loader is not None:
            loader.set_epoch(trainer.current_epoch)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loader = self._loader(trainer)
        if loader is None or (trainer.global_step % self.every):
            return
        m = loader.metrics()
        figures = {
            "wait_share": m.wait_share,
            "rows_per_s": m.rows_per_s,
            "writers_in_dataset": _mean([w.in_dataset for w in m.writers]),
            "writers_blocked": _mean([w.blocked for w in m.writers]),
            "lock_busy_share": m.lock_busy_share,
            "fill_mean": m.fill_mean,
        }
        known = {f"gigashuffle/{k}": float(v) for k, v in figures.items() if not math.isnan(v)}
        pl_module.log_dict(known, rank_zero_only=False)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
