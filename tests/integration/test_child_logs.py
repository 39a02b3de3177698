"""NOTE [ Child logs ] in procs/childlogs.py: a child logs at the levels its trainer's script set, to stderr, each
line naming the child; a trainer in its own process (child_logs_job.py) so that its logging and stderr are its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from timing import startup_deadline

JOB = Path(__file__).with_name("child_logs_job.py")
_JOB_S = startup_deadline(120.0, startups=2)


def _run(redis_url: str, tmp_path: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), *sys.path])}
    cmd = [sys.executable, str(JOB), "--redis-url", redis_url, "--passes", str(tmp_path / "passes"), *args]
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=_JOB_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _child(role: str, index: int, level: str, name: str) -> str:
    return rf"^\S+ \S+ \[gigashuffle {role} {index}, rank 0, pid \d+\] {level} {re.escape(name)}: "


@pytest.mark.parametrize("configured", [True, False], ids=["script-configures-logging", "default"])
def test_a_childs_lines_follow_the_trainers_levels_and_name_the_child(
    redis_url: str, tmp_path: Path, configured: bool
) -> None:
    err = _run(redis_url, tmp_path, *(["--configure"] if configured else []))
    for writer in (0, 1):  # each writer's dataset warns once per pass: at every level
        assert re.search(_child("writer", writer, "WARNING", "otherlib") + "otherlib warning", err, re.M), err
    idle = _child("writer", 1, "INFO", "gigashuffle.procs.chunks") + r".*this writer's share is empty"
    own_debug = _child("writer", 0, "DEBUG", "mydataset") + "mydataset debug from the writer"
    if configured:  # basicConfig(level=INFO), and DEBUG for the dataset's logger
        assert re.search(idle, err, re.M), err
        assert re.search(own_debug, err, re.M), err
    else:  # Python's default: WARNING and up
        assert not re.search(idle, err, re.M) and "mydataset debug" not in err, err
    assert "otherlib debug" not in err, "a logger the script did not lower stays at the root's level"
