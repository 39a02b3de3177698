"""An independent, atomic look at where every slot of a node's buffer is, for tests to check stats() against.

``stats()`` reports counts; this maps the node's slot table itself (through an attach socket, as a process of the
node would) and reads its state and holder arrays under the table's lock, so the look is atomic.
"""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import json
import os
import signal
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np
import psutil
import redis
from forked import fork_child, wait_child

from gigashuffle.control.client import connect
from gigashuffle.control.keys import QueueKeys
from gigashuffle.control.plane import ControlPlane
from gigashuffle.errors import AttachError
from gigashuffle.procs.nodefds import fetch_node_fds
from gigashuffle.shm import journal
from gigashuffle.shm.journal import H_LENGTH
from gigashuffle.shm.memfd import SharedMemory
from gigashuffle.shm.slottable import (
    EMPTY,
    FULL,
    READING,
    READING_EVICT,
    WRITING,
    ShuffleBufferStats,
    SlotTable,
    table_nbytes,
)


@dataclass(frozen=True)
class TableSnapshot:
    """Slot counts by state, counted from ``state`` itself under the node lock: the oracle that the header's counts
    (``stats()``, journaled with every transition) are checked against."""

    empty: int
    writing: int
    full: int
    reading: int

    def stats(self) -> ShuffleBufferStats:
        return ShuffleBufferStats(self.full, self.empty, self.writing + self.reading)


def snapshot(table: SlotTable, wait_s: float | None = None) -> TableSnapshot:
    """Count every slot's state under the lock (a pass over the whole table: tests only)."""
    with table._locked(wait_s):
        state = table.state
        empty, writing, full = (int(np.count_nonzero(state == s)) for s in (EMPTY, WRITING, FULL))
    return TableSnapshot(empty, writing, full, table.slots - empty - writing - full)


@contextlib.contextmanager
def node_table(url: str, keys: QueueKeys, shuffle_size: int) -> Iterator[SlotTable | None]:
    """The node's slot table, mapped through any attach socket its processes list (None if nobody serves it)."""
    client = connect(url, total_timeout_s=5.0)
    try:
        try:
            buffer_fd, table_fd = fetch_node_fds(ControlPlane(client, keys), keys.queue, 2.0)
        except AttachError:
            yield None
            return
        os.close(buffer_fd)
        table = SlotTable(shuffle_size, SharedMemory(table_nbytes(shuffle_size), table_fd))
        try:
            yield table
        finally:
            table.close()
    finally:
        client.close()


def audit_slots(url: str, keys: QueueKeys, shuffle_size: int, *, settled: bool = True) -> dict[str, Any]:
    """One atomic look at the slot table (under its lock): every slot in exactly one known state, the header's
    counts of full and empty slots equal to the states', and an empty journal.

    With ``settled`` every slot being written or read must also be held by a live, registered process (those
    of dead ones were repaired).
    """
    with node_table(url, keys, shuffle_size) as table:
        assert table is not None, "no process serves the node buffer and its slot table"
        with table._locked():  # rolls forward an op a dead holder journaled: the journals are empty after it
            state, holder = table.state.copy(), table.holder.copy()
            journaled = sum(int(s.header[H_LENGTH]) for s in table._stripes) + int(table._wide.header[H_LENGTH])
            counted = table.counts()[2]  # the stripes' headers' counts, summed (NOTE [ Stripes ])
    with redis.Redis.from_url(url, socket_timeout=10.0) as client:
        procs = {int(json.loads(v)["pid"]) for v in client.hvals(keys.procs)}
    assert len(state) == shuffle_size
    unknown = sorted(set(np.unique(state).tolist()) - {EMPTY, WRITING, FULL, READING, READING_EVICT})
    assert not unknown, f"slots in unknown states {unknown}"
    held = np.isin(state, (WRITING, READING, READING_EVICT))
    empty, full = int((state == EMPTY).sum()), int((state == FULL).sum())
    assert journaled == 0, "a journaled op was left after the lock's roll-forward"
    assert (counted.full, counted.empty) == (full, empty), (
        f"the headers count {counted.full} full and {counted.empty} empty slots, the states {full} and {empty}"
    )
    if settled:
        orphans = sorted(p for p in set(holder[held].tolist()) if p not in procs or not psutil.pid_exists(p))
        assert not orphans, f"slots held by processes that are dead or not registered (never repaired): {orphans}"
    return {"empty": empty, "full": full, "leased": int(held.sum())}


def lock_is_free(table: SlotTable) -> bool:
    """True if nobody holds a lock of the table: stripe 0's flock, nor any other stripe's OFD lock on its byte (NOTE
    [ Stripe locks ] in shm/nodelock.py), probed through a fresh open file description of the table's memfd."""
    if table.fd is None:
        raise AssertionError("table has no fd")
    fd = os.open(f"/proc/self/fd/{table.fd}", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for k in range(1, table.stripes):
            probe = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, k, 1, 0))
            if struct.unpack("hhqqi4x", probe)[0] != fcntl.F_UNLCK:
                return False
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def repair_killed_in_the_journal(table: SlotTable) -> int:
    """Fork a process that repairs ``table`` and is SIGKILLed on the journal line that turns a read slot full again
    (``Journal._apply_by_state``), so the repair's op is journaled and half applied; its wait status."""
    apply = journal.Journal._apply_by_state
    lines, first = inspect.getsourcelines(apply)
    target = {first + k for k, text in enumerate(lines) if "old == READING)] = FULL" in text}

    def repair_then_die() -> int:
        def stop(frame: FrameType, event: str, arg: object) -> Any:
            if event == "line" and frame.f_code.co_filename == journal.__file__ and frame.f_lineno in target:
                os.kill(os.getpid(), signal.SIGKILL)
            return stop

        sys.settrace(stop)
        table.repair()
        return 1

    return wait_child(fork_child(repair_then_die))
