"""A node buffer larger than the memory the node can give is refused when it is made, in the training process, with
an error that names ``shuffle_size`` and what fits (NOTE [ A buffer the node cannot hold ] in host/memory.py);
without the check it was made (a sparse memfd) and failed only once nearly full, as an OOM kill."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from datasets import DEADLINE_S, WideRows, take

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader, WorkerDied
from gigashuffle.host.memory import WARN_SHARE, available

ROW_BYTES = 1 << 20


def _config(redis_url: str, shuffle_size: int) -> DataloaderConfig:
    return DataloaderConfig(
        bs=2, shuffle_size=shuffle_size, queue_name=f"mem-{uuid.uuid4().hex[:8]}", num_writers=1, num_readers=1,
        redis_url=redis_url, min_mixing=0.0,
    )  # fmt: skip


def _room() -> int:
    found = available()
    # Without a figure the writer would make the buffer and fill this machine: stop before any loader starts.
    assert found is not None, "no memory figure on this host (/proc/meminfo): the check would not run"
    return found[0]


def test_a_buffer_larger_than_the_available_memory_is_refused_naming_shuffle_size(redis_url: str) -> None:
    slots = 2 * _room() // ROW_BYTES + 64  # twice what the node can hold, in 1 MiB rows
    loader = MultiprocessShuffledDataloader(WideRows(ROW_BYTES), _config(redis_url, slots))
    with loader, pytest.raises(WorkerDied) as caught:
        take(iter(loader), 1)
    message = str(caught.value)
    assert "ValueError" in message, message
    assert f"DataloaderConfig.shuffle_size={slots} is too large for this node" in message, message
    # What fits follows from the figures the message gives (the host's memory moves meanwhile: not from _room()).
    figures = re.search(r"needs ([\d.]+) GiB, and .* leaves ([\d.]+) GiB.*Use shuffle_size <= (\d+)", message)
    assert figures is not None, message
    needs, leaves, fits = float(figures.group(1)), float(figures.group(2)), int(figures.group(3))
    assert 0 < fits < slots and abs(fits - slots * leaves / needs) <= slots / 1000, message


def test_a_buffer_near_the_available_memory_is_made_with_a_warning(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The check itself, as the writer runs it, on this host's figure: no 20 GiB buffer is made to show the warning.
    from gigashuffle.host.memory import refuse_a_buffer_too_large

    room = _room()
    with caplog.at_level(logging.WARNING, logger="gigashuffle.host.memory"):
        refuse_a_buffer_too_large(int(room * (WARN_SHARE + 1) / 2), 1000, ROW_BYTES, "q")
    assert any("takes" in r.getMessage() and "of the memory available now" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gigashuffle.host.memory"):
        refuse_a_buffer_too_large(room // 10, 1000, ROW_BYTES, "q")
    assert not caplog.records


_CGROUP_V1 = Path("/sys/fs/cgroup/memory")
_CGROUP_V2 = Path("/sys/fs/cgroup")


def _memory_cgroup_mount() -> tuple[Path, str, str] | None:
    """Where this root process can make a memory cgroup: (mount, limit file, its "no limit" value)."""
    if os.geteuid() != 0:
        return None
    if (_CGROUP_V1 / "memory.limit_in_bytes").exists():
        return _CGROUP_V1, "memory.limit_in_bytes", "-1"
    controllers = _CGROUP_V2 / "cgroup.subtree_control"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return _CGROUP_V2, "memory.max", "max"
    return None


# What the trainer scripts start with (_in_a_memory_cgroup puts it first): join the cgroup; limit_to(extra)
# limits it to its usage that cannot be reclaimed (less page cache, as host/memory.py counts it) plus extra bytes.
_JOIN = r"""
import json, os, sys
from pathlib import Path
sys.path[:0] = sys.argv[4].split(os.pathsep)
from datasets import WideRows, take
group, limit_file, unlimited, redis_url = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[5]
(group / "cgroup.procs").write_text(str(os.getpid()))

def limit_to(extra):
    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
    usage_file = "memory.usage_in_bytes" if limit_file.endswith("in_bytes") else "memory.current"
    prefix = "total_" if "total_inactive_file" in stat else ""
    cache = int(stat.get(prefix + "active_file", 0)) + int(stat.get(prefix + "inactive_file", 0))
    (group / limit_file).write_text(str(int((group / usage_file).read_text()) - cache + extra))
"""

# The trainer joins the cgroup before it starts its processes, fills a buffer of 64 MiB, then limits the cgroup to
# its unreclaimable usage plus 24 MiB: the buffer is in, a copy of its rows is not. Prints one JSON line.
_TRAINER = r"""
from gigashuffle import CheckpointError, DataloaderConfig, MultiprocessShuffledDataloader
cfg = DataloaderConfig(bs=4, shuffle_size=256, queue_name=f"cgmem-{os.getpid()}", num_writers=1, num_readers=1,
                       redis_url=redis_url, min_mixing=1.0)
out = {}
with MultiprocessShuffledDataloader(WideRows(1 << 18), cfg) as loader:
    it = iter(loader)
    take(it, 8)
    limit_to(24 << 20)
    try:
        loader.state_dict()
        out["state_dict"] = "saved"
    except CheckpointError as exc:
        out["state_dict"] = str(exc)
    out["after"] = len(take(it, 20))
    (group / limit_file).write_text(unlimited)
    out["state_dict_unlimited"] = sorted(loader.state_dict())
print(json.dumps(out))
"""


def test_a_saved_checkpoint_whose_copy_the_memory_cannot_hold_fails_before_the_pause_and_the_loader_goes_on(
    redis_url: str,
) -> None:
    out = _in_a_memory_cgroup(_TRAINER, redis_url)
    assert out["state_dict"].startswith("state_dict() on queue"), out
    assert "checkpoint_rows='saved' copies the buffer's full rows" in out["state_dict"], out
    assert f"the limit of memory cgroup {out['group']}" in out["state_dict"], out
    assert out["after"] == 20, out  # the loader delivers on after the refused checkpoint
    assert out["state_dict_unlimited"] == ["rank0"], out  # and checkpoints again once the memory is there


# The trainer joins the cgroup and limits it to its unreclaimable usage plus 1.5 GiB (room for the loader's
# processes, forked from a zygote that shares its pages), then asks for a buffer of 2 GiB.
_BUFFER_TRAINER = r"""
from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader, WorkerDied
limit_to(3 << 29)
cfg = DataloaderConfig(bs=2, shuffle_size=2048, queue_name=f"cgbuf-{os.getpid()}", num_writers=1, num_readers=1,
                       redis_url=redis_url, min_mixing=1.0)
out = {}
with MultiprocessShuffledDataloader(WideRows(1 << 20), cfg) as loader:
    try:
        take(iter(loader), 1)
        out["error"] = None
    except WorkerDied as exc:
        out["error"] = str(exc)
print(json.dumps(out))
"""


def test_a_buffer_larger_than_its_memory_cgroup_allows_is_refused_naming_the_cgroup(redis_url: str) -> None:
    out = _in_a_memory_cgroup(_BUFFER_TRAINER, redis_url)
    assert out["error"] is not None, out
    assert "DataloaderConfig.shuffle_size=2048 is too large for this node" in out["error"], out
    assert "the limit of memory cgroup" in out["error"], out


def _in_a_memory_cgroup(script: str, redis_url: str) -> dict[str, Any]:
    """Run ``script`` (after ``_JOIN``) as a trainer in a memory cgroup of its own; its last stdout line, as JSON."""
    found = _memory_cgroup_mount()
    if found is None:
        pytest.skip("needs root and a memory cgroup mount to limit a trainer's memory")
    mount, limit_file, unlimited = found
    group = mount / f"gs-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as exc:  # a read-only cgroup mount (a container's default)
        pytest.skip(f"cannot make a memory cgroup under {mount}: {exc}")
    try:
        here = Path(__file__).parent
        done = subprocess.run(
            [sys.executable, "-c", _JOIN + script, str(group), limit_file, unlimited,
             os.pathsep.join([str(here), str(here.parent)]), redis_url],
            capture_output=True, text=True, timeout=DEADLINE_S, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        result["group"] = str(group)
        return result
    finally:
        _remove_cgroup(group)


def _remove_cgroup(group: Path) -> None:
    """rmdir once the trainer's processes left it (they exit with the loader's close; the zygote a moment later)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            group.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
