"""A few faults of tests/soak/nodesoak.py per checkpoint way: two ranks of one node share a buffer; child kills,
node checkpoints, Ctrl-C on every rank or on one inside them, then a resume of the merged checkpoint; every row once
across the node, and nothing of either rank left grown. Long runs are in docs/soak.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from timing import startup_deadline

SOAK = Path(__file__).with_name("nodesoak.py")


@pytest.mark.parametrize("way", ["saved", "positions"])
def test_a_short_node_soak_loses_nothing_repeats_nothing_and_grows_nothing(redis_url: str, way: str) -> None:
    # Seed 98's first six faults are one of each kind (the schedule is the seed's alone, the same on both ranks).
    args = ["--ranks", "2", "--events", "8", "--seed", "98", "--warmup-s", "1", "--settle-s", "1"]
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
    assert set(report["kinds"]) == report["events"].keys(), report
    # Both Ctrl-C kinds interrupted a call, and every failed round was taken again on both ranks.
    outcomes = report["outcomes_all_ranks"]
    assert outcomes.get("interrupted", 0) > 0 and outcomes.get("retaken", 0) > 0, outcomes
    assert report["rows_checked"] > 0 and report["rows_after_resume"] > 0, report
