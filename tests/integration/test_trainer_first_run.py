"""``GigashuffleTrainer.train(resume_from_checkpoint=True)`` on a first run, which has no checkpoint (issue 35,
item 2: README's line raised a bare ``No valid checkpoint found``): the error names the fix that README's script
uses, and nothing is loaded or trained."""

from __future__ import annotations

from pathlib import Path

import pytest
from datasets import Counter
from test_transformers_trainer import Model, _arguments, _config

from gigashuffle import MultiprocessShuffledDataloader
from gigashuffle.integrations.transformers import GigashuffleTrainer  # transformers: checked by the import above

pytestmark = pytest.mark.timeout(300)


def test_resume_true_on_a_first_run_names_get_last_checkpoint(redis_url: str, tmp_path: Path) -> None:
    with MultiprocessShuffledDataloader(Counter(), _config(redis_url)) as loader:
        trainer = GigashuffleTrainer(model=Model(), args=_arguments(tmp_path / "out"), loader=loader)
        with pytest.raises(ValueError, match=r"No valid checkpoint found") as refused:
            trainer.train(resume_from_checkpoint=True)
        assert trainer.state.global_step == 0
    message = str(refused.value)
    assert "get_last_checkpoint(output_dir)" in message and "else None" in message, message
