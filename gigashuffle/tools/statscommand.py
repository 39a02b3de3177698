"""``gigashuffle stats``: its options, the table, JSON and Prometheus forms of a frame, and the refresh loop of
``--watch``. The servers it lists come from :mod:`.statsservers`.

Only the standard library at module level, as in ``tools/cli.py``: the command must start at once.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any, TextIO

from gigashuffle.tools.stats import (
    Sample,
    needs_second_record,
    prometheus_text,
    short_generation,
    with_rates,
)
from gigashuffle.tools.statsservers import CliError, _fixed_server, _no_embedded_server, _Servers

COLUMNS = ["queue", "node", "size", "full", "empty", "in_flight", "ranks", "processes", "written_per_s",
           "read_per_s", "lock_busy_pct", "generation"]  # fmt: skip
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: what top does between refreshes
DEFAULT_WATCH_S = 2.0
DEFAULT_INTERVAL_S = 5.0  # 2.5 heartbeats (HEARTBEAT_S in control/session.py): a second record comes by then


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        return "-" if value is None else str(value)

    rows = [{**r, "generation": short_generation(r["generation"])} for r in rows]

    widths = {c: max([len(c), *(len(cell(r[c])) for r in rows)]) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS).rstrip()]
    lines += ["  ".join(cell(r[c]).ljust(widths[c]) for c in COLUMNS).rstrip() for r in rows]
    if not rows:
        lines.append("(no gigashuffle queues on this server)")
    return "\n".join(lines)


def _show(rows: list[dict[str, Any]], urls: list[str], args: argparse.Namespace, out: TextIO, frame: int) -> None:
    if args.prometheus:
        if args.watch is not None and frame:
            out.write("\n")  # one exposition per refresh, a blank line between them
        out.write(prometheus_text(rows))
    elif args.json:
        # One document per refresh; under --watch one compact line each (JSON Lines), so a pipe can parse it.
        out.write(json.dumps(rows, separators=(",", ":")) + "\n" if args.watch else json.dumps(rows, indent=2) + "\n")
    else:
        if args.watch is not None:
            if out.isatty():
                out.write(_CLEAR)
            elif frame:
                out.write("\n")
            stamp = time.strftime("%H:%M:%S")
            where = ", ".join(urls) or _no_embedded_server()
            out.write(f"gigashuffle stats  {stamp}  every {args.watch:g} s  {where}\n")
        out.write(format_table(rows) + "\n")
    out.flush()


def stats_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--redis",
        "--redis-url",
        dest="redis",
        metavar="URL",
        default=None,
        help="the server to list (default: $GIGASHUFFLE_REDIS_URL, else every node's embedded server on this machine)",
    )
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="print JSON (under --watch: one line per refresh)")
    shape.add_argument(
        "--prometheus",
        action="store_true",
        help="print the Prometheus text format (gigashuffle_node_rows_per_second{server,queue,node} etc.; the "
        "per-rank figures are each trainer's loader.metrics().to_prometheus())",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="SECONDS",
        help="rates are taken between two of a node's counter records, made every 2 s; in a job's first seconds "
        f"the first frame waits up to SECONDS for a second one (default {DEFAULT_INTERVAL_S:g}; 0: never waits)",
    )
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=DEFAULT_WATCH_S,
        default=None,
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C, like top",
    )
    parser.add_argument("--count", type=int, default=None, metavar="N", help="stop after N refreshes (with --watch)")
    parser.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="how long Redis may not answer (default 5)"
    )
    return parser


def _end_on_sigint() -> threading.Event:
    """Ctrl-C ends a watch: an event the loop checks, set by our own handler.

    Python's default handler only raises KeyboardInterrupt, which a library call may swallow (an exception in a
    ``__del__`` or a finalizer is only printed) or which never comes when SIGINT was ignored by whoever started
    us; then a watch would refresh forever. The handler is installed explicitly, and the loop checks the event.
    """
    interrupted = threading.Event()

    def handle(_signum: int, _frame: Any) -> None:
        interrupted.set()

    signal.signal(signal.SIGINT, handle)
    return interrupted


def _first_samples(servers: _Servers, wait_s: float) -> list[Sample]:
    """The first frame's samples, once every queue has two counter records or after ``wait_s`` (NOTE [ Stats rates ]
    in tools/stats.py): the first frame shows rates too, in the first seconds of a job as well."""
    samples = servers.sample()
    deadline = time.monotonic() + wait_s
    while needs_second_record(samples) and time.monotonic() < deadline:
        time.sleep(0.1)
        samples = servers.sample()
    return samples


def stats(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    if args.watch is not None and not args.watch > 0:
        raise CliError(f"--watch {args.watch:g} is invalid: use a positive number of seconds")
    if args.count is not None and args.count < 1:
        raise CliError(f"--count {args.count} is invalid: use 1 or more refreshes")
    if not args.timeout > 0:
        raise CliError(f"--timeout {args.timeout:g} is invalid: use a positive number of seconds")
    watching = args.watch is not None
    servers = _Servers(_fixed_server(args.redis), args.timeout)
    interrupted = _end_on_sigint() if watching else threading.Event()
    try:
        servers.refresh()
        # A Prometheus scraper asks whether or not a loader runs: no server is an exposition without samples.
        if not servers.urls and not watching and not args.prometheus:
            raise CliError(
                f"{_no_embedded_server()}; pass --redis URL for another server, or set GIGASHUFFLE_REDIS_URL"
            )
        previous: list[Sample] = []
        first = _first_samples(servers, args.interval)
        count = args.count if watching else 1
        frame = 0
        while True:
            if frame:
                servers.refresh()
            current = servers.sample() if frame else first
            _show(with_rates(current, previous), servers.urls, args, out, frame)
            frame += 1
            if (count is not None and frame >= count) or interrupted.is_set():
                return 0
            previous = current
            if interrupted.wait(args.watch):
                return 0
    except KeyboardInterrupt:
        return 0 if watching else 130  # Ctrl-C is how a watch ends; anywhere else it interrupts
    finally:
        servers.close()
