"""What ``gigashuffle stats`` shows: one row per queue and node found on a server's control plane, with rates.

Only the standard library at module level, as in ``tools/cli.py``: the command must start at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gigashuffle.control.client import Client
    from gigashuffle.control.plane import ControlPlane


@dataclass(frozen=True)
class Sample:
    """The state of one queue on one node at one moment, with the raw counters rates are computed from."""

    row: dict[str, Any]
    written: int
    read: int
    at: float
    lock_held_ns: int = 0  # the node lock's total hold time, as a heartbeat last recorded it (0: none yet)
    lock_at_ns: int = 0  # when the node read that total (CLOCK_MONOTONIC of the node's machine)


def _scan(client: Client, pattern: str) -> list[str]:
    from gigashuffle.control.plane import text

    # A cluster client's scan_iter visits every primary, so queues on every shard are listed.
    return sorted({text(k) for k in client.scan_iter(match=pattern, count=1000)})


def _stores(client: Client) -> list[ControlPlane]:
    from gigashuffle.control.keys import META_PATTERN, QueueKeys
    from gigashuffle.control.plane import ControlPlane

    return [
        ControlPlane(client, QueueKeys(*parsed))
        for meta_key in _scan(client, META_PATTERN)
        if (parsed := QueueKeys.parse_tag(meta_key)) is not None
    ]


def sample(client: Client, server: str = "") -> list[Sample]:
    """One sample per queue and node found on the server (rates left empty: see :func:`with_rates`)."""
    from gigashuffle.control.plane import text

    samples = []
    for store in _stores(client):
        keys = store.keys
        written, read, lock_held_ns, lock_at_ns = store.counters()
        at = time.monotonic()
        stats = store.stats()  # slot counts as a trainer's heartbeat last recorded them (every HEARTBEAT_S)
        size = int(store.meta().get("slots", b"0"))
        ranks = len(_scan(client, keys.rank_pattern))
        row = {
            "queue": keys.queue,
            "node": keys.node,
            "size": size,
            "full": stats.full,
            "empty": stats.empty,
            "in_flight": stats.in_flight,
            "ranks": ranks,
            "processes": stats.processes,
            "written_per_s": None,
            "read_per_s": None,
            "lock_busy_pct": None,
            "generation": text(stats.generation) if stats.generation else "",
            "server": server,
        }
        samples.append(Sample(row, written, read, at, lock_held_ns, lock_at_ns))
    return samples


def with_rates(now: list[Sample], before: list[Sample]) -> list[dict[str, Any]]:
    """The rows of ``now``, with rows/s since the same queue's sample in ``before`` (None where it has none)."""
    earlier = {(s.row["server"], s.row["queue"], s.row["node"]): s for s in before}
    rows = []
    for s in now:
        row = dict(s.row)
        prev = earlier.get((row["server"], row["queue"], row["node"]))
        # A counter that went down belongs to a new session (Redis restarted or flushed): no rate across it.
        if prev is not None and s.at > prev.at and s.written >= prev.written and s.read >= prev.read:
            row["written_per_s"] = round((s.written - prev.written) / (s.at - prev.at))
            row["read_per_s"] = round((s.read - prev.read) / (s.at - prev.at))
        if prev is not None:
            row["lock_busy_pct"] = _lock_busy_pct(prev, s)
        rows.append(row)
    return rows


def _lock_busy_pct(before: Sample, now: Sample) -> float | None:
    """The share of time the node lock was held between two of the node's own readings (taken on its clock, not
    between our samples: heartbeats record them every ``HEARTBEAT_S``, at moments of their own); None without two
    readings in order, e.g. when two ranks' heartbeats landed out of order."""
    if not before.lock_at_ns or now.lock_at_ns <= before.lock_at_ns or now.lock_held_ns < before.lock_held_ns:
        return None
    return round(100 * (now.lock_held_ns - before.lock_held_ns) / (now.lock_at_ns - before.lock_at_ns), 1)


def queue_rows(client: Client, interval_s: float = 1.0) -> list[dict[str, Any]]:
    """One row per queue and node found on the server; rates are measured over ``interval_s`` (0: none), or longer
    until every queue's written and read counters moved: trainers record them every ``HEARTBEAT_S``, so a
    shorter window may see none. At most ``2.5 * HEARTBEAT_S`` (an idle queue's counters never move)."""
    from gigashuffle.control.session import HEARTBEAT_S

    before = sample(client)
    if not before or interval_s <= 0:
        return with_rates(before, [])
    longest = time.monotonic() + max(interval_s, 2.5 * HEARTBEAT_S)
    time.sleep(interval_s)
    now = sample(client)
    old = {(s.row["queue"], s.row["node"]): s for s in before}

    def moved(s: Sample) -> bool:
        prev = old.get((s.row["queue"], s.row["node"]))
        return prev is None or (s.written != prev.written and s.read != prev.read)

    while time.monotonic() < longest and not all(moved(s) for s in now):
        time.sleep(0.05)
        now = sample(client)
    return with_rates(now, before)
