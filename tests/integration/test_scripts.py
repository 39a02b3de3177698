"""Training code as people write it, run as real interpreters: a dataset class defined in ``python -c``, in code
piped to the interpreter (what a REPL or a notebook cell gives: the class lives in ``__main__``), in a script's
``__main__`` behind the usual guard, and in a script without any ``if __name__ == "__main__":`` guard.

Each program prints ``BODY`` once per run of its top level and a JSON line with the rows of the batches it read
and whether a training context (an instance of a class from ``__main__``) reached the writers.
The zygote must never run the main module again, so ``BODY`` appears exactly once (a second run would also build
a second loader on the same queue and fail with ``QueueInUseError``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from datasets import DEADLINE_S

import gigashuffle

REPO_ROOT = Path(gigashuffle.__file__).resolve().parent.parent

# The dataset refers to a module-level helper and constant, as real scripts do: cloudpickle must carry them too.
PROGRAM = """
import itertools, json
import torch
from torch.utils.data import IterableDataset, get_worker_info
from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader

OFFSET = 1000

def rows_from(n):
    return torch.arange(n, n + 8, dtype=torch.int64) + OFFSET

class Step:
    def __init__(self, k):
        self.k = k

class Rows(IterableDataset):
    def __iter__(self):
        base = get_worker_info().id * 10**6
        for n in itertools.count(0, 8):
            ids = rows_from(base + n)
            step = getattr(self, "context", None)
            yield [{{"id": ids, "twice": ids * 2, "step": torch.full((8,), step.k if step else -1)}}]

print("BODY", flush=True)
{main}
"""

LOADER = """
cfg = DataloaderConfig(bs=4, shuffle_size=32, queue_name={queue!r}, num_writers=2, num_readers=1,
                       redis_url={url!r})
with MultiprocessShuffledDataloader(Rows(), cfg) as loader:
    it = iter(loader)
    batches = [next(it)[0] for _ in range(10)]
    loader.attach_training_context(Step(7))  # an instance of a class from __main__ reaches the writers too
    context_seen = any(7 in next(it)[0]["step"].tolist() for _ in range(2000))
    print(json.dumps({{"id": [b["id"].tolist() for b in batches], "twice": [b["twice"].tolist() for b in batches],
                      "context_seen": context_seen}}))
"""


def _program(redis_url: str, guarded: bool) -> str:
    loader = LOADER.format(queue=f"script-{uuid.uuid4().hex[:8]}", url=redis_url)
    if guarded:
        loader = 'if __name__ == "__main__":\n' + textwrap.indent(loader, "    ")
    return PROGRAM.format(main=loader)


def _run(argv: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, *argv],
        check=False,
        cwd=cwd,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )


def _check(proc: subprocess.CompletedProcess[str]) -> None:
    detail = f"exit code {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, detail
    lines = proc.stdout.splitlines()
    assert lines.count("BODY") == 1, f"the main module ran more than once:\n{detail}"
    result = json.loads(lines[-1])
    ids = [i for batch in result["id"] for i in batch]
    assert len(ids) == 40 and len(set(ids)) == 40, f"rows read twice or missing:\n{detail}"
    assert all(i >= 1000 for i in ids), f"the module-level OFFSET did not reach the writers:\n{detail}"
    assert [[2 * i for i in batch] for batch in result["id"]] == result["twice"], f"torn rows:\n{detail}"
    assert result["context_seen"], f"a training context of a class from __main__ never reached the writers:\n{detail}"


@pytest.mark.usefixtures("runtime_dir")
@pytest.mark.parametrize("how", ["dash_c", "stdin", "script_with_guard", "script_without_guard"])
def test_a_dataset_defined_in_main_produces_batches(redis_url: str, tmp_path: Path, how: str) -> None:
    program = _program(redis_url, guarded=how == "script_with_guard")
    if how == "dash_c":
        proc = _run(["-c", program], tmp_path)
    elif how == "stdin":
        proc = _run(["-"], tmp_path, stdin=program)
    else:
        script = tmp_path / "train.py"
        script.write_text(program)
        proc = _run([str(script)], tmp_path)
    _check(proc)
