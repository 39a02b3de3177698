"""The training scripts of README.md (and docs/), run as written, twice: a first run and a resumed run.

A fenced block right after a line ``<!-- snippet: NAME -->`` is written verbatim to ``NAME`` in a fresh folder
(the Python scripts import ``toy.py``, a snippet too) and run there as README says: ``python NAME`` or under
``torchrun``. The ``.sh`` snippet's lines are the commands themselves. Each script takes its step count as its
argument: the first run trains ``FIRST`` steps, the second is started with ``FIRST + MORE`` and must resume.

What "resumed" means is checked from outside the scripts: the framework's own state says the step count went on
(Lightning's ``last.ckpt``, the Trainer's ``trainer_state.json``, the checkpoint's name), the second run delivered
only the batches of the steps left, and none of the rows the first run trained on came back. The rows each loader
delivered are recorded by ``snippet_recorder/sitecustomize.py``, put on the scripts' ``PYTHONPATH``: it wraps
``MultiprocessShuffledDataloader.__iter__`` in every process, and notes each ``DistributedDataParallel`` built,
and changes nothing else. The toy dataset's rows follow from each writer's position, so a run that started afresh
instead of resuming would deliver the first run's rows again. Under torchrun every rank must have trained one
model of both ranks (a DDP of world size 2): on a machine without GPUs the Trainer and accelerate otherwise let each
rank train a model of its own, checkpoints and all, and every other check here passes.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from timing import startup_deadline

import gigashuffle

REPO_ROOT = Path(gigashuffle.__file__).resolve().parent.parent
DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
RECORDER = Path(__file__).with_name("snippet_recorder")
SNIPPET = re.compile(r"^<!-- snippet: (?P<name>[\w.-]+) -->\n```\w*\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
DEADLINE_S = startup_deadline(180.0, startups=40)

pytestmark = pytest.mark.timeout(900)


def snippets() -> dict[str, str]:
    found: dict[str, str] = {}
    for document in DOCUMENTS:
        for match in SNIPPET.finditer(document.read_text()):
            assert match["name"] not in found, f"two snippets named {match['name']!r}"
            found[match["name"]] = match["code"]
    return found


@dataclass(frozen=True)
class Script:
    steps: Callable[[Path], int | None]  # the step its last checkpoint in the run's folder saved (None: none)
    ahead: int  # batches the framework may draw beyond its last step


def _lightning_steps(folder: Path) -> int | None:
    last = folder / "checkpoints" / "last.ckpt"
    return int(torch.load(last, weights_only=False)["global_step"]) if last.exists() else None


def _trainer_steps(folder: Path) -> int | None:
    saved = sorted((folder / "out").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return int(json.loads((saved[-1] / "trainer_state.json").read_text())["global_step"]) if saved else None


def _accelerate_steps(folder: Path) -> int | None:
    return max((int(p.name.split("-")[1]) for p in (folder / "checkpoints").glob("step-*")), default=None)


TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
SCRIPTS = {
    "train_lightning.py": Script(_lightning_steps, ahead=2),  # the one torchrun broke (world size)
    "train_trainer.py": Script(_trainer_steps, ahead=2),  # without use_cpu: a model per rank
    "train_accelerate.py": Script(_accelerate_steps, ahead=0),  # without cpu=True: a model per rank
}
ONE_PROCESS = ("train_trainer.py", "train_accelerate.py")  # also run as `python NAME`
FIRST, MORE = 100, 100  # the scripts checkpoint every 50 steps


def _env(tmp_path: Path, record: Path, redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(RECORDER), str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    record.mkdir()
    # The test's Redis through the variable a config without redis_url reads (no embedded server to start).
    env.update(GIGASHUFFLE_SNIPPET_RECORD=str(record), GIGASHUFFLE_REDIS_URL=redis_url, TMPDIR=str(tmp_path),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    return env


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{shlex.join(command)} did not end within {DEADLINE_S:.0f} s:\n{out[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"{shlex.join(command)} exited {proc.returncode}:\n{out[-8000:]}"
    return out


def _ddp_world_sizes(record: Path) -> dict[int, list[int]]:
    """Per rank, the world size of each ``DistributedDataParallel`` its process built."""
    return {
        int(path.name[8:].split("-")[0]): [int(n) for n in path.read_text().split()]
        for path in record.glob("ddp-rank*-*")
    }


def _delivered(record: Path) -> dict[int, list[list[str]]]:
    """Per rank, the row digests of each batch its loader delivered, in order."""
    by_rank: dict[int, list[list[str]]] = {}
    for path in record.glob("rank*-*.jsonl"):
        rank = int(path.name[4:].split("-")[0])
        assert rank not in by_rank, f"rank {rank} iterated loaders in two processes"
        by_rank[rank] = [json.loads(line) for line in path.read_text().splitlines()]
    return by_rank


def _check_resumed(first: dict[int, list[list[str]]], second: dict[int, list[list[str]]], trained: int,
                   more: int, ahead: int) -> None:  # fmt: skip
    assert sorted(first) == sorted(second) and first, (sorted(first), sorted(second))
    for rank, batches in first.items():
        assert trained <= len(batches) <= trained + ahead, f"rank {rank}: {len(batches)} batches in the first run"
        # A run that started again from step 0 would draw a batch for every step up to FIRST + MORE.
        assert more <= len(second[rank]) <= more + ahead, (
            f"rank {rank} drew {len(second[rank])} batches in the resumed run, for {more} steps"
        )
    before = {row for batches in first.values() for batch in batches[:trained] for row in batch}
    after = [row for batches in second.values() for batch in batches for row in batch]
    assert len(after) == len(set(after)), "the resumed run delivered a row twice"
    again = before.intersection(after)
    assert not again, f"{len(again)} of the {len(before)} rows trained on before the checkpoint were delivered again"


@pytest.mark.usefixtures("runtime_dir")
@pytest.mark.parametrize(
    ("name", "torchrun"),
    [
        *(pytest.param(n, True, marks=pytest.mark.torchrun, id=f"{n}-torchrun") for n in SCRIPTS),
        *(pytest.param(n, False, id=f"{n}-python") for n in ONE_PROCESS),
    ],
)
def test_a_readme_training_script_runs_and_its_second_run_resumes(
    tmp_path: Path, redis_url: str, name: str, torchrun: bool
) -> None:
    script = SCRIPTS[name]
    code = snippets()
    for file in ("toy.py", name):
        (tmp_path / file).write_text(code[file])
    launch = TORCHRUN_2 if torchrun else [sys.executable]
    outputs, records = [], []
    for run, steps in (("first", FIRST), ("second", FIRST + MORE)):
        record = tmp_path / f"record-{run}"
        outputs.append(_run([*launch, name, str(steps)], tmp_path, _env(tmp_path, record, redis_url)))
        saved = script.steps(tmp_path)
        assert saved == steps, (
            f"the {run} run's last checkpoint is of step {saved}, not {steps}:\n{outputs[-1][-4000:]}"
        )
        records.append(_delivered(record))
        if torchrun:  # one data-parallel job: every rank wraps the model in DDP over both ranks
            ddp = _ddp_world_sizes(record)
            assert ddp == {0: [2], 1: [2]}, (
                f"the {run} run's DDP models (rank: world sizes): {ddp}\n{outputs[-1][-4000:]}"
            )
    _check_resumed(*records, trained=FIRST, more=MORE, ahead=script.ahead)
    if name == "train_lightning.py":
        assert "Restored all states from the checkpoint" in outputs[1], outputs[1][-4000:]
        _check_lightning_logs(tmp_path)


def _check_lightning_logs(folder: Path) -> None:
    """GigashuffleCallback's figures in the log Lightning writes by default, each run's steps after the last's: its
    CSVLogger's ``metrics.csv`` (Lightning's default without tensorboard; with it, the events files go unread)."""
    runs = sorted((folder / "lightning_logs").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:]))
    if not runs and list((folder / "lightning_logs").glob("version_*/events.out.tfevents.*")):
        return
    assert len(runs) == 2, f"one metrics.csv per run (a run that logged nothing writes none): {runs}"
    last = -1
    for run in runs:
        rows = list(csv.DictReader(run.read_text().splitlines()))
        logged = [row for row in rows if row.get("gigashuffle/wait_share")]
        assert logged, f"no gigashuffle/wait_share in {run}: {rows[:3]}"
        steps = [int(row["step"]) for row in logged]
        assert min(steps) > last, f"{run}: steps {steps} after {last}"
        last = max(steps)


@pytest.mark.torchrun
@pytest.mark.usefixtures("runtime_dir")
def test_the_readme_torchrun_example_runs_and_resumes(tmp_path: Path, redis_url: str) -> None:
    """README's two command lines as they are, in the repository's root; the checkpoint goes to ``$TMPDIR``."""
    lines = [shlex.split(line, comments=True) for line in snippets()["train_torchrun.sh"].splitlines()]
    first, second = (line for line in lines if line)
    assert first[0] == second[0] == "torchrun" and second == [*first, "--resume"], lines
    steps = int(first[first.index("--steps") + 1])
    checkpoint = tmp_path / "gigashuffle-example-checkpoints" / "rank0.pt"
    records = []
    for run, command in (("first", first), ("second", second)):
        record = tmp_path / f"record-{run}"
        out = _run(
            [*TORCHRUN_2[:3], *command[1:]], REPO_ROOT, _env(tmp_path, record, redis_url)
        )  # torchrun, as a module
        records.append(_delivered(record))
        assert _ddp_world_sizes(record) == {0: [2], 1: [2]}, _ddp_world_sizes(record)
        saved = torch.load(checkpoint, weights_only=False)["step"]
        assert saved == steps * (1 if run == "first" else 2), f"the {run} run saved step {saved}"
    assert f"resumed at step {steps} from {checkpoint}" in out, out[-4000:]
    # A row carries the epoch it was made in, and the resumed run starts in a later epoch: only the rows its
    # checkpoint saved (the node's buffer, each rank's undelivered batches) can be of an earlier one. A resume
    # that lost them would deliver none and log 100% at its first report.
    fresh = re.search(r"^step +\d+ +epoch \d+ +loss [\d.]+ +rows from this epoch +(\d+)%", out, re.MULTILINE)
    assert fresh is not None and int(fresh[1]) < 100, f"the checkpoint's rows did not come back:\n{out[-4000:]}"
    _check_resumed(*records, trained=steps, more=steps, ahead=0)


TRAINING_CALLS = re.compile(r"\.fit\(|\.train\(|save_state\(|load_state\(|GigashuffleTrainer\(|torchrun .*train")


def test_every_training_snippet_of_the_docs_is_one_these_tests_run() -> None:
    """A code block that trains with a framework (or launches the training example) and carries no snippet
    marker would go untested: each must be marked, and each marked script is run above. (Untagged blocks are
    transcripts of output, as in docs/multinode.md.)"""
    unmarked = []
    for document in DOCUMENTS:
        text = document.read_text()
        marked = {m.start("code") for m in SNIPPET.finditer(text)}
        for block in re.finditer(r"^```(?:python|bash)\n(?P<code>.*?)^```$", text, re.MULTILINE | re.DOTALL):
            if TRAINING_CALLS.search(block["code"]) and block.start("code") not in marked:
                line = text.count("\n", 0, block.start()) + 1
                unmarked.append(f"{document.relative_to(REPO_ROOT)}:{line}")
    assert not unmarked, f"training snippets without a '<!-- snippet: NAME -->' line: {unmarked}"
    run = {*SCRIPTS, "toy.py", "train_torchrun.sh"}
    assert set(snippets()) == run, f"snippets no test runs: {set(snippets()) - run}; missing: {run - set(snippets())}"
