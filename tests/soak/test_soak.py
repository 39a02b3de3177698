"""A few seconds of tests/soak/soak.py per checkpoint way: random child kills, checkpoints and Ctrl-C inside them, then
a resume; every row once, and nothing of the trainer's (fds, threads, mappings, children) left grown. Long runs
are in docs/soak.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

Run = Callable[[str, list[str]], dict[str, Any]]  # the soak_report fixture (tests/soak/conftest.py)


# Each way once, one of them over a slot table in 4 stripes (NOTE [ Stripes ]): the node soak's ways take the other
# table, so both ways run on both tables.
@pytest.mark.parametrize(("way", "stripes"), [("saved", 4), ("positions", 1)])
def test_a_short_soak_loses_nothing_repeats_nothing_and_grows_nothing(soak_report: Run, way: str, stripes: int) -> None:
    # The schedule is the seed's alone: seed 12's first 16 faults are of every kind (4, 4, 3, 2 and 3).
    args = ["--seconds", "0", "--events", "16", "--event-s", "0.15", "--seed", "12", "--lock-stripes", str(stripes)]
    report = soak_report("soak.py", [*args, "--warmup-s", "1", "--settle-s", "1", "--way", way])
    assert report["lock_stripes"] == stripes, report
