"""Hugging Face ``Trainer``: the loader as the train dataloader, its state saved in every ``checkpoint-*`` and
restored on resume.

``GigashuffleTrainer(loader=..., args=..., model=...)`` is a ``Trainer`` whose ``get_train_dataloader()`` is the
loader (use ``DataloaderConfig(batch_format="dict", index_key=False)`` so that ``model(**batch)`` gets only the
dataset's fields, and ``steps_per_epoch`` or ``max_steps`` for the length). At each save, every rank's state is
gathered (NOTE [ Rank-keyed state ] in integrations/state.py) and the main process writes it to
``checkpoint-N/gigashuffle_loader.pt``; ``train(resume_from_checkpoint=...)`` restores each rank's part before
training. The Trainer's own data skipping would replay batches on resume, so ``ignore_data_skip=True`` is required.
Every ``logging_steps`` the loader's figures join the Trainer's logs as ``gigashuffle/...``: added in ``log()``,
before the Trainer appends the logs to ``state.log_history`` and hands them to its callbacks, so the printed log,
``trainer_state.json`` and every ``report_to`` logger have them (NOTE [ Trainer logs ]).
Install with ``pip install gigashuffle[transformers]``.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from gigashuffle import MultiprocessShuffledDataloader

log = logging.getLogger(__name__)

STATE_FILE = "gigashuffle_loader.pt"

# NOTE [ Trainer logs ]
# ``Trainer.log(logs)`` appends a copy of ``logs`` to ``state.log_history`` and then calls every callback's
# ``on_log`` in registration order: the printer or progress callback and the ``report_to`` integrations are
# registered in ``Trainer.__init__``, before anything a subclass adds, and ``log_history`` is written before any
# callback runs. A callback that adds the loader's figures reaches neither (issue 35). So the figures are added in
# the ``log()`` override, before the Trainer's own ``log()`` does anything with ``logs``.
# Evaluation logs (``eval_*``, ``test_*``) are of another data set: they get no figures of the train loader.
_EVALUATION_PREFIXES = ("eval_", "test_", "predict_")


class GigashuffleTrainer(Trainer):  # type: ignore[misc,unused-ignore]  # Any where transformers is absent
    def __init__(self, *args: Any, loader: MultiprocessShuffledDataloader, **kwargs: Any) -> None:
        if not isinstance(loader, MultiprocessShuffledDataloader):
            raise TypeError(f"GigashuffleTrainer(loader=...) needs a MultiprocessShuffledDataloader, got {loader!r}")
        if loader.config.batch_format != "dict":
            raise ValueError(
                f"DataloaderConfig.batch_format={loader.config.batch_format!r} is invalid for GigashuffleTrainer: the "
                "Trainer calls model(**batch), which needs a batch that is a dict, and a 'list' batch is a list of "
                'dicts; build the loader with DataloaderConfig.from_env(..., batch_format="dict", index_key=False)'
            )
        super().__init__(*args, **kwargs)
        if not self.args.ignore_data_skip:
            raise ValueError(
                "TrainingArguments.ignore_data_skip=False is invalid with a gigashuffle loader: on resume the Trainer "
                "would draw and drop the batches of the steps already trained, while the loader resumes from its own "
                "state; use TrainingArguments(ignore_data_skip=True)"
            )
        self.gigashuffle_loader = loader
        self.add_callback(_LoaderState(loader))

    def get_train_dataloader(self) -> Any:
        return self.gigashuffle_loader

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log()``, with the loader's figures added first (NOTE [ Trainer logs ])."""
        if not any(key.startswith(_EVALUATION_PREFIXES) for key in logs):
            logs.update(loader_figures(self.gigashuffle_loader))
        super().log(logs, *args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:  # the Trainer's own rule, applied early to load the loader's state
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)  # type: ignore[no-untyped-call,unused-ignore]
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"No valid checkpoint found in output directory ({self.args.output_dir}): "
                    "train(resume_from_checkpoint=True) needs one, and a first run has none; in a script that may be "
                    "the first run, pass transformers.trainer_utils.get_last_checkpoint(output_dir) when output_dir "
                    "exists, else None (README, Training frameworks)"
                )
        if isinstance(resume_from_checkpoint, str):
            load_loader_state(self.gigashuffle_loader, resume_from_checkpoint)
        return super().train(resume_from_checkpoint or None, *args, **kwargs)


def loader_figures(loader: MultiprocessShuffledDataloader) -> dict[str, float]:
    """The loader's main figures as ``gigashuffle/...`` log entries, the ones the Lightning callback logs; figures
    that are not known yet (NaN) and a closed loader give none."""
    if loader.closed:
        return {}
    m = loader.metrics()
    writers = m.writers
    figures = {
        "wait_share": m.wait_share,
        "rows_per_s": m.rows_per_s,
        "writers_in_dataset": sum(w.in_dataset for w in writers) / len(writers) if writers else math.nan,
        "writers_blocked": sum(w.blocked for w in writers) / len(writers) if writers else math.nan,
        "lock_busy_share": m.lock_busy_share,
        "fill_mean": m.fill_mean,
    }
    return {f"gigashuffle/{k}": float(v) for k, v in figures.items() if not math.isnan(v)}


def load_loader_state(loader: MultiprocessShuffledDataloader, checkpoint: str) -> None:
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.exists(path):
        raise ValueError(
            f"resume_from_checkpoint={checkpoint!r} has no {STATE_FILE}: it was not saved by GigashuffleTrainer; "
            "resume from one of its checkpoints, or start without resume_from_checkpoint"
        )
    merged = torch.load(path, weights_only=False)  # written by this job's main process (it holds dataset states)
    loader.load_state_dict(merged)  # takes this rank's part; a missing one: CheckpointError
    log.info("gigashuffle: loader state restored from %s", path)


class _LoaderState(TrainerCallback):  # type: ignore[misc,unused-ignore]
    def __init__(self, loader: MultiprocessShuffledDataloader) -> None:
        self.loader = loader

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        merged = self.loader.gathered_state_dict()  # every rank calls on_save: the gather is a collective
        if state.is_world_process_zero:
            folder = os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            torch.save(merged, os.path.join(folder, STATE_FILE))
