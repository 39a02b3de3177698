"""A few faults of tests/soak/nodesoak.py per checkpoint way: two ranks of one node share a buffer; child kills,
node checkpoints, Ctrl-C on every rank or on one inside them, then a resume of the merged checkpoint; every row once
across the node, and nothing of either rank left grown. Long runs are in docs/soak.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

Run = Callable[[str, list[str]], dict[str, Any]]  # the soak_report fixture (tests/soak/conftest.py)


# Each way once, one of them over a slot table in 4 stripes (NOTE [ Stripes ]); test_soak.py's ways take the other.
@pytest.mark.parametrize(("way", "stripes"), [("saved", 1), ("positions", 4)])
def test_a_short_node_soak_loses_nothing_repeats_nothing_and_grows_nothing(
    soak_report: Run, way: str, stripes: int
) -> None:
    # Seed 98's first six faults are one of each kind (the schedule is the seed's alone, the same on both ranks).
    args = ["--ranks", "2", "--events", "8", "--seed", "98", "--warmup-s", "1", "--settle-s", "1"]
    report = soak_report("nodesoak.py", [*args, "--way", way, "--lock-stripes", str(stripes)])
    assert report["lock_stripes"] == stripes, report
    assert set(report["kinds"]) == report["events"].keys(), report
    # Both Ctrl-C kinds interrupted a call, and every failed round was taken again on both ranks.
    outcomes = report["outcomes_all_ranks"]
    assert outcomes.get("interrupted", 0) > 0 and outcomes.get("retaken", 0) > 0, outcomes
