"""``GigashuffleTrainer`` in one process, a real Trainer over a real loader: the loader's figures reach the Trainer's
logs (issue 35, item 1), and a config the Trainer cannot feed to a model is refused when the trainer is built.

What a user reads is checked where a user reads it: ``trainer.state.log_history``, ``trainer_state.json`` of a
checkpoint, the log the Trainer prints, a ``report_to`` logger and a logger of the user's own. None of the packages
of transformers' ``report_to`` integrations (tensorboard, wandb, ...) is installed here, so the test adds one of its
own to the table they are looked up in (``INTEGRATION_TO_CALLBACK``) and names it in ``report_to``: the Trainer
builds it as it builds those, in its constructor, before anything the subclass adds. The user's logger is a
callback given to the constructor, registered after the integrations and before the printer.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Counter

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader

pytest.importorskip("transformers")
from transformers import TrainerCallback, TrainingArguments
from transformers.integrations import integration_utils

from gigashuffle.integrations.transformers import GigashuffleTrainer

pytestmark = pytest.mark.timeout(300)

STEPS, LOGGING_STEPS = 6, 2


class Model(torch.nn.Module):
    """``model(**batch)`` over Counter's fields (a stateful dataset: the Trainer's checkpoint saves the loader)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, id: torch.Tensor, counter: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.linear(id.float().unsqueeze(1) / 1e9).squeeze(1)
        return {"loss": torch.nn.functional.mse_loss(prediction, counter.float() / 1e3)}


class UserLogger(TrainerCallback):  # type: ignore[misc]
    """What a ``report_to`` integration does with the logs: keep what ``on_log`` hands it."""

    def __init__(self) -> None:
        self.logged: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
        self.logged.append(dict(logs))


def _config(redis_url: str, **overrides: Any) -> DataloaderConfig:
    settings: dict[str, Any] = dict(
        bs=4, shuffle_size=64, queue_name=f"hf-{uuid.uuid4().hex[:8]}", num_writers=1, num_readers=1,
        redis_url=redis_url, min_mixing=0.25, batch_format="dict", index_key=False,
    )  # fmt: skip
    settings.update(overrides)
    return DataloaderConfig(**settings)


class ReportedLogs(UserLogger):
    """A ``report_to`` integration: the Trainer makes it from its name in ``TrainingArguments.report_to``."""


REPORT_TO = "gigashuffle-test-recorder"


def _arguments(output_dir: Path, report_to: list[str] | None = None) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, logging_steps=LOGGING_STEPS, save_steps=STEPS,
        save_strategy="steps", ignore_data_skip=True, report_to=report_to or [], use_cpu=True, disable_tqdm=True,
        per_device_train_batch_size=4,
    )  # fmt: skip


def _training_logs(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if "loss" in entry]  # every logging_steps, not the run's summary


def test_the_loader_figures_reach_log_history_the_printed_log_a_report_to_logger_and_a_user_logger(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, REPORT_TO, ReportedLogs)
    logger = UserLogger()
    with MultiprocessShuffledDataloader(Counter(), _config(redis_url)) as loader:
        args = _arguments(tmp_path, report_to=[REPORT_TO])
        trainer = GigashuffleTrainer(model=Model(), args=args, loader=loader, callbacks=[logger])
        trainer.train()
    printed = capsys.readouterr().out
    (report_to,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ReportedLogs)]

    history = _training_logs(trainer.state.log_history)
    assert [entry["step"] for entry in history] == list(range(LOGGING_STEPS, STEPS + 1, LOGGING_STEPS)), history
    for entry in history:
        assert 0.0 <= entry["gigashuffle/wait_share"] <= 1.0, entry
        assert entry["gigashuffle/rows_per_s"] >= 0.0, entry

    saved = json.loads((tmp_path / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    assert all("gigashuffle/wait_share" in entry for entry in _training_logs(saved["log_history"])), saved

    for receiver in (report_to, logger):
        reported = _training_logs(receiver.logged)
        assert len(reported) == len(history), (type(receiver).__name__, receiver.logged)
        assert all("gigashuffle/wait_share" in entry for entry in reported), (type(receiver).__name__, reported)

    printed_logs = [line for line in printed.splitlines() if line.startswith("{") and "'loss'" in line]
    assert len(printed_logs) == len(history), printed
    assert all("'gigashuffle/wait_share'" in line for line in printed_logs), printed_logs


def test_a_list_batch_format_is_refused_when_the_trainer_is_built(redis_url: str, tmp_path: Path) -> None:
    config = _config(redis_url, batch_format="list")
    with MultiprocessShuffledDataloader(Counter(), config) as loader, pytest.raises(ValueError) as refused:
        GigashuffleTrainer(model=Model(), args=_arguments(tmp_path), loader=loader)
    message = str(refused.value)
    assert "DataloaderConfig.batch_format='list'" in message, message  # the field and the value
    assert 'batch_format="dict"' in message, message  # the fix
