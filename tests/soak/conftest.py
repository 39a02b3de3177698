"""The soak scripts' runs for their CI tests: a subprocess each (a soak installs its own SIGINT handler and sends
itself SIGINT), its JSON report checked for what every soak must hold."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from timing import startup_deadline

Run = Callable[[str, list[str]], dict[str, Any]]  # spelled again in the tests: conftest is not imported


@pytest.fixture
def soak_report(redis_url: str) -> Run:
    """``run(script, args)``: the report of ``tests/soak/<script>`` on the test Redis, once it passed (no failure
    line, exit 0, nothing lost or twice, every kind of fault done)."""

    def run(script: str, args: list[str]) -> dict[str, Any]:
        result = subprocess.run(
            [sys.executable, str(Path(__file__).with_name(script)), *args, "--redis-url", redis_url],
            check=False, capture_output=True, text=True, timeout=startup_deadline(240.0, 20),
        )  # fmt: skip
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        assert lines, f"no report (exit {result.returncode}):\n{result.stderr[-3000:]}"
        report: dict[str, Any] = json.loads(lines[-1])
        assert report["failures"] == [], f"{report['failures']}; events {report['events']}"
        assert result.returncode == 0, result.stderr[-3000:]
        assert (report["lost"], report["twice"]) == (0, 0)
        assert set(report["kinds"]) <= report["events"].keys(), report
        assert report["rows_checked"] > 0 and report["rows_after_resume"] > 0, report
        return report

    return run
