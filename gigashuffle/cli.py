"""The ``gigashuffle`` command: ``demo``, ``stats`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from .control import FLUSH_PERIOD_S, ControlPlane, text
from .keys import META_PATTERN, QueueKeys
from .redisconn import Client, connect
from .runtime import runtime_dir


def _scan(client: Client, pattern: str) -> list[str]:
    # A cluster client's scan_iter visits every primary, so queues on every shard are listed.
    return sorted({text(k) for k in client.scan_iter(match=pattern, count=1000)})


def queue_rows(client: Client, interval_s: float = 1.0) -> list[dict[str, Any]]:
    """One row per queue and node found on the server; rates are measured over ``interval_s``, or longer until
    every queue's written and read counters moved (processes flush them every ``FLUSH_PERIOD_S``), at most
    ``2.5 * FLUSH_PERIOD_S`` (an idle queue's counters never move)."""
    stores = [
        ControlPlane(client, QueueKeys(*parsed))
        for meta_key in _scan(client, META_PATTERN)
        if (parsed := QueueKeys.parse_tag(meta_key)) is not None
    ]
    before = [store.counters() for store in stores]
    started = time.monotonic()
    if stores and interval_s > 0:
        time.sleep(interval_s)
        longest = started + max(interval_s, 2.5 * FLUSH_PERIOD_S)

        def some_unchanged() -> bool:  # written or read of some queue not flushed since ``before``
            now = [store.counters() for store in stores]
            return any(n[0] == b[0] or n[1] == b[1] for n, b in zip(now, before, strict=True))

        while time.monotonic() < longest and some_unchanged():
            time.sleep(0.05)  # an idle queue keeps its counters: the wait ends at ``longest`` then
    elapsed = max(time.monotonic() - started, 1e-9)
    rows = []
    for store, (written_before, read_before) in zip(stores, before, strict=True):
        keys = store.keys
        written, read = store.counters()
        stats = store.stats()  # slot counts as the node's processes last flushed them (about once a second)
        size = int(store.meta().get("slots", b"0"))
        ranks = len(_scan(client, keys.rank(0).rsplit(":", 1)[0] + ":*"))
        rows.append(
            {
                "queue": keys.queue,
                "node": keys.node,
                "size": size,
                "full": stats.full,
                "empty": stats.empty,
                "in_flight": stats.in_flight,
                "ranks": ranks,
                "processes": stats.processes,
                "written_per_s": round((written - written_before) / elapsed) if interval_s > 0 else None,
                "read_per_s": round((read - read_before) / elapsed) if interval_s > 0 else None,
                "generation": text(stats.generation) if stats.generation else "",
            }
        )
    return rows


def _default_url() -> str:
    url = os.environ.get("GIGASHUFFLE_REDIS_URL")
    if url:
        return url
    return f"unix://{runtime_dir() / 'redis-n0.sock'}"


def stats_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="gigashuffle stats", description="List every queue on a Redis server.")
    parser.add_argument("--redis-url", default=None, help="default: $GIGASHUFFLE_REDIS_URL or this node's embedded")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds to measure rows/s over (0: no rates)")
    args = parser.parse_args(argv)
    client = connect(args.redis_url or _default_url(), total_timeout_s=5.0)
    try:
        rows = queue_rows(client, args.interval)
    finally:
        client.close()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    columns = ["queue", "node", "size", "full", "empty", "in_flight", "ranks", "processes", "written_per_s",
               "read_per_s", "generation"]  # fmt: skip
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) if rows else len(c) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row[c]).ljust(widths[c]) for c in columns))
    if not rows:
        print("(no gigashuffle queues on this server)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "run a real loader on the embedded Redis and report", "stats": "list queues",
                "bench": "loader vs copy floor vs DataLoader"}  # fmt: skip
    if not args or args[0] not in commands:
        usage = "\n".join(f"  {name:<6} {text_}" for name, text_ in commands.items())
        print(f"usage: gigashuffle <command> [options]\n\ncommands:\n{usage}", file=sys.stderr)
        return 2
    command, rest = args[0], args[1:]
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if command == "bench":
        from .bench.runner import main as bench_main

        return bench_main(rest)
    return stats_main(rest)


if __name__ == "__main__":
    sys.exit(main())
