"""The zygote's environment: glibc's streaming-store threshold for copies of large rows (procs._streaming_copies)."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import pytest

from gigashuffle.procs.zygoteclient import _streaming_copies

_LOADER = Path("/lib64/ld-linux-x86-64.so.2")  # the x86-64 dynamic loader; it lists the tunables it parsed

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="glibc's streaming-store threshold is x86-64 only"
)


def _tunables_seen_by_glibc(env: dict[str, str]) -> str:
    listed = subprocess.run(
        [str(_LOADER), "--list-tunables"], env=env, capture_output=True, text=True, check=True, timeout=30
    ).stdout
    return "\n".join(line for line in listed.splitlines() if "non_temporal" in line or "arena_max" in line)


@pytest.mark.parametrize(
    ("user", "threshold", "arena_max"),
    [
        (None, "0x10000", "0x0"),  # ours alone
        ("glibc.malloc.arena_max=2", "0x10000", "0x2"),  # ours added to the user's, both in force
        ("glibc.cpu.x86_non_temporal_threshold=1048576", "0x100000", "0x0"),  # the user's threshold wins
    ],
)
def test_threshold_is_added_and_glibc_applies_it(user: str | None, threshold: str, arena_max: str) -> None:
    env = {} if user is None else {"GLIBC_TUNABLES": user}
    env.update(_streaming_copies(env))
    if not _LOADER.exists():
        pytest.skip(f"no {_LOADER} to ask")
    seen = _tunables_seen_by_glibc(env)
    assert f"glibc.cpu.x86_non_temporal_threshold: {threshold} " in seen, seen
    assert f"glibc.malloc.arena_max: {arena_max} " in seen, seen
