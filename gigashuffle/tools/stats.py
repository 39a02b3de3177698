"""What ``gigashuffle stats`` shows: one row per queue and node found on a server's control plane, with rates.

Only the standard library at module level, as in ``tools/cli.py``: the command must start at once.

NOTE [ Stats rates ]
The rows written and read and the node lock's hold time live in the node's slot table; Redis sees them only as a
trainer's heartbeat records them, every ``HEARTBEAT_S`` (2 s), with the time of the reading on the node's own
``CLOCK_MONOTONIC``. A rate sampled over our own interval sees 0, 1 or 2 of those steps (it printed 28K and 0
alternately for a loader at 14K rows/s), so a rate here is always taken between two records, over the node's
clock: each record carries the same trainer's previous one (``prev_*``, see ``ControlPlane.record_counts``), so
one read gives a rate from the job's second heartbeat on; a record seen in an earlier frame serves too. In the
first seconds of a job, before the second heartbeat, the first frame waits for it (``--interval``, default 5 s).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gigashuffle import promtext

if TYPE_CHECKING:
    from gigashuffle.control.client import Client
    from gigashuffle.control.plane import ControlPlane

# Shown in the table: enough of a generation's random part to tell sessions apart (the whole is 73 characters).
GENERATION_CHARS = 8


@dataclass(frozen=True)
class Record:
    """One heartbeat's record of a node's counters: rows written and read, the node lock's total hold time, and
    when the node read them (ns of its ``CLOCK_MONOTONIC``; 0: no record)."""

    written: int = 0
    read: int = 0
    lock_held_ns: int = 0
    at_ns: int = 0


@dataclass(frozen=True)
class Sample:
    """The state of one queue on one node, with the last two counter records rates are computed from."""

    row: dict[str, Any]
    last: Record
    previous: Record = Record()


def _scan(client: Client, pattern: str) -> list[str]:
    from gigashuffle.control.plane import text

    # A cluster client's scan_iter visits every primary, so queues on every shard are listed.
    return sorted({text(k) for k in client.scan_iter(match=pattern, count=1000)})


def _stores(client: Client) -> list[ControlPlane]:
    from gigashuffle.control.keys import GEN_PATTERN, QueueKeys
    from gigashuffle.control.plane import ControlPlane

    # By the generation key, which the first trainer of a node sets as it joins: a queue is listed from the first
    # second of a job, before its buffer's metadata is published.
    return [
        ControlPlane(client, QueueKeys(*parsed))
        for gen_key in _scan(client, GEN_PATTERN)
        if (parsed := QueueKeys.parse_tag(gen_key)) is not None
    ]


def sample(client: Client, server: str = "") -> list[Sample]:
    """One sample per queue and node found on the server (rates left empty: see :func:`with_rates`)."""
    from gigashuffle.control.plane import text

    samples = []
    for store in _stores(client):
        keys = store.keys
        last, previous = store.counter_records()
        stats = store.stats()  # slot counts as a trainer's heartbeat last recorded them (every HEARTBEAT_S)
        slots = store.meta().get("slots")
        row = {
            "queue": keys.queue,
            "node": keys.node,
            "size": int(slots) if slots else None,  # None until the buffer is published
            "full": stats.full,
            "empty": stats.empty,
            "in_flight": stats.in_flight,
            "ranks": len(_scan(client, keys.rank_pattern)),
            "processes": stats.processes,
            "written_per_s": None,
            "read_per_s": None,
            "lock_busy_pct": None,
            "generation": text(stats.generation) if stats.generation else "",
            "server": server,
        }
        samples.append(Sample(row, Record(*last), Record(*previous)))
    return samples


def _key(s: Sample) -> tuple[str, str, str]:
    return s.row["server"], s.row["queue"], s.row["node"]


def with_rates(now: list[Sample], before: list[Sample]) -> list[dict[str, Any]]:
    """The rows of ``now``, with rates between the newest counter record and the newest one older than it, of
    this sample or of the same queue's sample in ``before`` (None where there are no two: NOTE [ Stats rates ])."""
    earlier = {_key(s): s for s in before}
    rows = []
    for s in now:
        row = dict(s.row)
        candidates = [s.previous]
        if (prev := earlier.get(_key(s))) is not None:
            candidates += [prev.last, prev.previous]
        older = [r for r in candidates if 0 < r.at_ns < s.last.at_ns]
        # Without a live rank claim no trainer records, and the last records are of a job that ended (or died):
        # its old rate would read as rows flowing now.
        if older and row.get("ranks") != 0:
            row.update(_rates(max(older, key=lambda r: r.at_ns), s.last))
        rows.append(row)
    return rows


def _rates(before: Record, now: Record) -> dict[str, Any]:
    """Rows/s and the lock's busy share between two records of one node's clock. Counters that went down belong
    to another slot table (a new session): no rate across them."""
    seconds = (now.at_ns - before.at_ns) / 1e9
    if now.written < before.written or now.read < before.read or now.lock_held_ns < before.lock_held_ns:
        return {}
    return {
        "written_per_s": round((now.written - before.written) / seconds),
        "read_per_s": round((now.read - before.read) / seconds),
        "lock_busy_pct": round(100 * (now.lock_held_ns - before.lock_held_ns) / (now.at_ns - before.at_ns), 1),
    }


def short_generation(generation: str) -> str:
    """The start of a generation's random part (``<server run_id>/<random>``): what tells two sessions apart."""
    return generation.rpartition("/")[2][:GENERATION_CHARS]


def needs_second_record(samples: list[Sample]) -> bool:
    """True while a queue with a live rank has fewer than two counter records (the first seconds of its job: the
    trainer maps the slot table once a child attached, then records at every heartbeat), so no rate yet."""
    return any(s.row.get("ranks") and not s.previous.at_ns for s in samples)  # no rank: no trainer will record


def queue_rows(client: Client, interval_s: float = 1.0, server: str = "") -> list[dict[str, Any]]:
    """One row per queue and node found on the server, with rates (NOTE [ Stats rates ]); while a queue has fewer
    than two counter records, waits for them: ``interval_s`` or ``2.5 * HEARTBEAT_S``, whichever is longer (0:
    never waits)."""
    from gigashuffle.control.session import HEARTBEAT_S

    samples = sample(client, server)
    deadline = time.monotonic() + (max(interval_s, 2.5 * HEARTBEAT_S) if interval_s > 0 else 0.0)
    while needs_second_record(samples) and time.monotonic() < deadline:
        time.sleep(0.1)
        samples = sample(client, server)
    return with_rates(samples, [])


# ``--prometheus``: the figures a server knows, per queue and node, named as ``LoaderMetrics.to_prometheus()`` names
# the same ones (the per-rank figures live in each trainer: its ``loader.metrics()``). Unknown rates (no two
# counter records yet) have no sample.
_PROMETHEUS = (
    ("buffer_slots", "size", 1, "gauge", "slots of the node buffer (shuffle_size)"),
    ("buffer_full_slots", "full", 1, "gauge", "full slots, as a trainer's heartbeat last recorded them"),
    ("buffer_empty_slots", "empty", 1, "gauge", "empty slots, as a trainer's heartbeat last recorded them"),
    ("buffer_in_flight_slots", "in_flight", 1, "gauge", "slots being written or read"),
    ("ranks", "ranks", 1, "gauge", "ranks that claim the queue on this node"),
    ("processes", "processes", 1, "gauge", "writers and readers holding slots on this node"),
    ("node_rows_per_second", "written_per_s", 1, "gauge", "rows written into the node's buffer per second"),
    ("node_read_rows_per_second", "read_per_s", 1, "gauge", "rows read out of the node's buffer per second"),
    ("lock_busy_share", "lock_busy_pct", 0.01, "gauge", "share of the time the node's slot-table lock was held"),
)


def prometheus_text(rows: list[dict[str, Any]], prefix: str = "gigashuffle") -> str:
    """``rows`` (of :func:`with_rates`) in the Prometheus text format, labelled by server, queue and node."""
    lines: list[str] = []
    for name, column, scale, kind, help_text in _PROMETHEUS:
        labelled = [({"server": r["server"], "queue": r["queue"], "node": r["node"]}, r[column]) for r in rows]
        samples = [(labels, x * scale) for labels, x in labelled if x is not None]
        lines += promtext.family(f"{prefix}_{name}", kind, help_text, samples)
    return "\n".join(lines) + "\n"
