"""A few seconds of tests/soak/soak.py per checkpoint way: random child kills, checkpoints and Ctrl-C inside them, then
a resume; every row once, and nothing of the trainer's (fds, threads, mappings, children) left grown. Long runs
are in docs/soak.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from timing import startup_deadline

SOAK = Path(__file__).with_name("soak.py")


@pytest.mark.parametrize("way", ["saved", "positions"])
def test_a_short_soak_loses_nothing_repeats_nothing_and_grows_nothing(redis_url: str, way: str) -> None:
    # A process of its own: the soak installs its own SIGINT handler and sends itself SIGINT.
    args = ["--seconds", "0", "--events", "16", "--event-s", "0.15", "--seed", "12"]
    args += ["--warmup-s", "1", "--settle-s", "1"]
    result = subprocess.run(
        [sys.executable, str(SOAK), *args, "--way", way, "--redis-url", redis_url],
        check=False, capture_output=True, text=True, timeout=startup_deadline(240.0, 20),
    )  # fmt: skip
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no report (exit {result.returncode}):\n{result.stderr[-3000:]}"
    report = json.loads(lines[-1])
    assert report["failures"] == [], f"{report['failures']}; events {report['events']}"
    assert result.returncode == 0, result.stderr[-3000:]
    assert (report["lost"], report["twice"]) == (0, 0)
    # The schedule is the seed's alone: seed 12's first 16 faults are of every kind (4, 4, 3, 2 and 3).
    assert set(report["kinds"]) <= report["events"].keys(), report
    assert report["rows_checked"] > 0 and report["rows_after_resume"] > 0, report
