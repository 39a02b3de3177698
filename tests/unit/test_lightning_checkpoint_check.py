"""``GigashuffleDataModule`` warns when a fit over an endless loader would save no checkpoint before it stops
(issue 35: Lightning's default checkpoint waits for an epoch's end, so ``fit(ckpt_path="last")`` found nothing)."""

from __future__ import annotations

import datetime
from types import SimpleNamespace
from typing import Any

import pytest

pl = pytest.importorskip("lightning.pytorch")

from gigashuffle import DataloaderConfig  # noqa: E402
from gigashuffle.integrations.lightning import no_checkpoint_before_the_end  # noqa: E402


def _loader(**fields: Any) -> Any:
    return SimpleNamespace(config=DataloaderConfig(bs=4, shuffle_size=64, queue_name="q", **fields))


def _trainer(tmp_path: Any, **kwargs: Any) -> Any:
    return pl.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, **kwargs)


def test_only_epoch_end_checkpoints_over_an_endless_loader_are_flagged(tmp_path: Any) -> None:
    endless = _loader()
    assert no_checkpoint_before_the_end(_trainer(tmp_path), endless), "Lightning's default checkpoint"
    periodic = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=50, save_last=True)
    assert not no_checkpoint_before_the_end(_trainer(tmp_path, callbacks=[periodic]), endless)
    timed = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, train_time_interval=datetime.timedelta(hours=1))
    assert not no_checkpoint_before_the_end(_trainer(tmp_path, callbacks=[timed]), endless)
    assert not no_checkpoint_before_the_end(_trainer(tmp_path, enable_checkpointing=False), endless), "opted out"
    assert not no_checkpoint_before_the_end(_trainer(tmp_path), _loader(steps_per_epoch=10)), "epochs end"
