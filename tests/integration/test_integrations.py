"""Each framework integration for real: a tiny model on two ranks under torchrun (gloo, CPU), a checkpoint through
the framework, a SIGKILL of every rank, and a resume in a new job whose every rank gets its own writers' states
back (``framework_job.py`` says what each phase does).

What is checked is the state contract (NOTE [ Rank-keyed state ] in gigashuffle/integrations/state.py): every rank's
state reaches the checkpoint although the framework writes rank 0's, and every rank restores its own part (a
writer given another's state fails the job). Rows in flight at the checkpoint coming back exactly once is the
loader's own checkpoint's claim, tested with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from timing import startup_deadline

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(600)]

JOB = Path(__file__).with_name("framework_job.py")
WORLD = 2
NUM_WRITERS = 2
DEADLINE_S = startup_deadline(240.0, startups=40)


def _torchrun(
    tmp_path: Path, framework: str, phase: str, redis_url: str, queue: str
) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", str(JOB),
        "--framework", framework, "--phase", phase, "--dir", str(tmp_path), "--redis-url", redis_url,
        "--queue", queue,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), str(JOB.parent), str(JOB.parent.parent)]),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode, out, "")


@pytest.mark.parametrize("framework", ["lightning", "transformers", "accelerate", "dcp"])
def test_checkpoint_kill_and_resume_restore_every_rank(tmp_path: Path, redis_url: str, framework: str) -> None:
    pytest.importorskip({"dcp": "torch", "lightning": "lightning"}.get(framework, framework))
    queue = f"{framework}-{uuid.uuid4().hex[:8]}"  # the resumed job is of the same queue: a checkpoint names it
    saved = _torchrun(tmp_path, framework, "save", redis_url, queue)
    assert saved.returncode != 0, "the save phase must end killed:\n" + saved.stdout[-4000:]
    assert "Signal 9" in saved.stdout or "SIGKILL" in saved.stdout, saved.stdout[-4000:]
    resumed = _torchrun(tmp_path, framework, "resume", redis_url, queue)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    restored: dict[str, list[int]] = {}
    saved_positions: dict[str, int] = {}
    for rank in range(WORLD):  # the ranks share the node's buffer: each sees rows of every writer
        result = json.loads((tmp_path / f"result-{rank}.json").read_text())
        for wid, values in result["resumed"].items():
            restored.setdefault(wid, []).extend(v for v in values if v >= 0)
        saved_positions.update(result["saved"] or {})
    writers = {str(w) for w in range(WORLD * NUM_WRITERS)}
    assert set(restored) == writers, restored
    for wid, values in restored.items():
        assert len(set(values)) == 1, (framework, wid, restored)  # restored once (a slow writer may be at 0)
    if saved_positions:  # the checkpoint file names every writer's position: each got exactly its own
        assert {wid: values[0] for wid, values in restored.items()} == saved_positions, (restored, saved_positions)
    elif framework != "dcp":
        raise AssertionError(f"{framework}: the job did not read its checkpoint file")
